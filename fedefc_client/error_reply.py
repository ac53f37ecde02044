"""The ClientApp's outermost mod: a failure leaves the node as an error reply whose text
names no private path or node-config value (docs/PRIVACY.md §6). It imports neither
torch nor the run's code, so that it also covers the node's first check
(:func:`.node.identity_mod`)."""

from __future__ import annotations

from logging import ERROR

from flwr.app import Context, Error, Message
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from .scrub import exception_text, private_strings, scrub


def error_reply_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Every failure leaves the node as an error reply whose text names no private path
    or node-config value (:func:`.scrub.scrub`): an exception (Flower would send its text
    as it is) or an inner mod's error reply. The full exception goes to the node's own
    log, and the node's state is put back as it was before the message (as Flower does
    for a ClientApp that raises), so a failed message changes nothing on the node."""
    saved = dict(ctxt.state.items())
    try:
        out = call_next(msg, ctxt)
    except Exception as err:
        log(ERROR, "the ClientApp failed on a %s message (the server gets this text without "
            "its paths)", msg.metadata.message_type, exc_info=err)
        ctxt.state.clear()
        ctxt.state.update(saved)
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                             exception_text(err, private_strings(ctxt.node_config))),
                       reply_to=msg)
    if not out.has_error():
        return out
    return Message(Error(out.error.code, scrub(out.error.reason or "",
                                               private_strings(ctxt.node_config))),
                   reply_to=msg)
