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

import os
from collections.abc import Iterable

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.serverapp.grid import Grid
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from common.config import RunConfig
from common.faults import ServerFault, parse_server_faults, server_fault
from common.messages import Declaration
from common.verifiable_shares import COMMITMENTS, commitment_degree, deal, read_commitment

DECLARATION = "getpropertiesres.properties"  # a get_properties reply's record (Flower's)


class DishonestGrid:
    """``grid`` with the server ``faults`` applied to every message sent through it;
    ``partitions`` (node id -> partition) learnt from the nodes' declarations passing
    through, for the faults aimed at some partitions' nodes."""

    def __init__(self, grid: Grid, faults: list[ServerFault]):
        self.grid = grid
        self.faults = faults
        self.partitions: dict[int, int] = {}

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        replies = list(self.grid.send_and_receive([self.corrupt(m) for m in messages],
                                                  timeout=timeout))
        for reply in replies:
            declared = (None if reply.has_error() else
                        reply.content.config_records.get(DECLARATION, {}).get(
                            Declaration.PARTITION_ID))
            if isinstance(declared, int):
                self.partitions[reply.metadata.src_node_id] = declared
        return replies

    def corrupt(self, msg: Message) -> Message:
        """``msg`` as the faults of its round change it: a training message's
        ``clipping_norm`` (``clip``); a SecAgg+ setup's threshold, sample size and, for
        the nodes aimed at, ``max_weight`` (``secagg-threshold``, ``secagg-sample``,
        ``secagg-max-weight``); the dealers' commitments relayed to the nodes aimed at
        (``secagg-commitments``: forged ones); an unmask request's first active node named
        dropped too (``unmask-both``)."""
        rnd = int(msg.metadata.group_id or 0)
        pid = self.partitions.get(msg.metadata.dst_node_id)
        records = msg.content.config_records
        if "fitins.config" in records and (f := server_fault(self.faults, "clip", rnd)):
            records["fitins.config"][KEY_CLIPPING_NORM] = float(f.arg)
        stage = records.get(RECORD_KEY_CONFIGS)
        if stage is None:
            return msg
        if stage.get(Key.STAGE) == Stage.SETUP:
            # Flower's workflow sends every node one content: each node gets its own copy
            msg.content = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(dict(stage))})
            stage = msg.content.config_records[RECORD_KEY_CONFIGS]
            for kind, key in (("secagg-threshold", Key.THRESHOLD),
                              ("secagg-sample", Key.SAMPLE_NUMBER)):
                if f := server_fault(self.faults, kind, rnd):
                    stage[key] = int(f.arg)
            if f := server_fault(self.faults, "secagg-max-weight", rnd, pid):
                stage[Key.MAX_WEIGHT] = float(f.arg)
        if (stage.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS and COMMITMENTS in stage
                and server_fault(self.faults, "secagg-commitments", rnd, pid)):
            stage[COMMITMENTS] = [forged(c) for c in stage[COMMITMENTS]]
        if (stage.get(Key.STAGE) == Stage.UNMASK and stage.get(Key.ACTIVE_NODE_ID_LIST)
                and server_fault(self.faults, "unmask-both", rnd)):
            stage[Key.DEAD_NODE_ID_LIST] = [*stage[Key.DEAD_NODE_ID_LIST],
                                            stage[Key.ACTIVE_NODE_ID_LIST][0]]
        return msg


def forged(commitment: bytes) -> bytes:
    """A commitment of the same threshold and length to another secret: what a server
    that wants the holders' channel keys would relay instead of a dealer's."""
    sealed = read_commitment(commitment)[1]
    return deal(os.urandom(len(sealed)), commitment_degree(commitment), [1])[0]


def with_server_faults(grid: Grid, cfg: RunConfig) -> Grid:
    """The grid the ServerApp sends through: ``grid``, or a :class:`DishonestGrid` over
    it when the run has ``server-faults``."""
    faults = parse_server_faults(cfg.server_faults)
    return DishonestGrid(grid, faults) if faults else grid
