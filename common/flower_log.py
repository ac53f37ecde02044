"""Flower's console lines with the time they were written (docs/DEPLOYMENT.md, "Reading
a run's logs").

Flower's console handler writes ``INFO :      message``, a time only under
``FLWR_LOG_LEVEL=DEBUG``: an operator reading a SuperNode's log or a run's stream after an
outage cannot tell when anything happened. Every process the project starts or loads
turns Flower's own option on (``update_console_handler(timestamps=True)``): the
ServerApp and ClientApp processes when they load the app, the SuperLink, SuperNodes and
SuperExecs through :mod:`fedefc_cli.flower_repairs`. Their lines read ``INFO 2026-12-07
12:18:20,123:      message`` (this machine's local time).
"""

from __future__ import annotations

from flwr.common.logger import update_console_handler


def timestamp_flower_lines() -> None:
    """Flower's console lines in this process carry the time they were written."""
    update_console_handler(timestamps=True)
