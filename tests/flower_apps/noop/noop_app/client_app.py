"""The ClientApp: answers ``query`` with nothing and ``train`` with the arrays it got."""

from __future__ import annotations

import os
from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def _mark(context: Context) -> None:
    folder = str(context.run_config["marker-dir"])
    if folder:
        Path(folder, f"clientapp-{context.node_id}-{os.getpid()}").write_text("ran")


@app.query()
def query(msg: Message, context: Context) -> Message:
    _mark(context)
    return Message(RecordDict(), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    _mark(context)
    return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)
