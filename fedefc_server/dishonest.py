"""A dishonest server, replayable from a run config (``server-faults``,
:mod:`common.faults`; docs/THREAT-MODEL.md, "A dishonest server and the node").

The project's ServerApp is honest; what a server that runs other code could send the
nodes is replayed by :class:`DishonestGrid`, a wrapping grid below everything the
ServerApp sends through (the round loop's client proxies, the SecAgg+ workflow and its
screening grid): each outgoing message is changed as the faults say, after the
ServerApp's own checks, as another ServerApp would have written it. The nodes must
refuse what breaks the run they signed for (``fedefc_client/server_checks.py``). The
ServerApp wraps its grid once (:func:`with_server_faults`); without ``server-faults``
nothing here runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.serverapp.grid import Grid
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from common.config import RunConfig
from common.faults import ServerFault, parse_server_faults, server_fault


class DishonestGrid:
    """``grid`` with the server ``faults`` applied to every message sent through it."""

    def __init__(self, grid: Grid, faults: list[ServerFault]):
        self.grid = grid
        self.faults = faults

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        return self.grid.send_and_receive([self.corrupt(m) for m in messages],
                                          timeout=timeout)

    def corrupt(self, msg: Message) -> Message:
        """``msg`` as the faults of its round change it: a training message's
        ``clipping_norm`` (``clip``); a SecAgg+ setup's threshold and sample size
        (``secagg-threshold``, ``secagg-sample``); an unmask request's first active node
        named dropped too (``unmask-both``)."""
        rnd = int(msg.metadata.group_id or 0)
        records = msg.content.config_records
        if "fitins.config" in records and (f := server_fault(self.faults, "clip", rnd)):
            records["fitins.config"][KEY_CLIPPING_NORM] = float(f.arg)
        stage = records.get(RECORD_KEY_CONFIGS)
        if stage is None:
            return msg
        if stage.get(Key.STAGE) == Stage.SETUP:
            for kind, key in (("secagg-threshold", Key.THRESHOLD),
                              ("secagg-sample", Key.SAMPLE_NUMBER)):
                if f := server_fault(self.faults, kind, rnd):
                    stage[key] = int(f.arg)
        if (stage.get(Key.STAGE) == Stage.UNMASK and stage.get(Key.ACTIVE_NODE_ID_LIST)
                and server_fault(self.faults, "unmask-both", rnd)):
            stage[Key.DEAD_NODE_ID_LIST] = [*stage[Key.DEAD_NODE_ID_LIST],
                                            stage[Key.ACTIVE_NODE_ID_LIST][0]]
        return msg


def with_server_faults(grid: Grid, cfg: RunConfig) -> Grid:
    """The grid the ServerApp sends through: ``grid``, or a :class:`DishonestGrid` over
    it when the run has ``server-faults``."""
    faults = parse_server_faults(cfg.server_faults)
    return DishonestGrid(grid, faults) if faults else grid
