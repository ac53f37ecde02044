"""One training round under secure aggregation: Flower's SecAgg+ workflow driving the
project's strategy (docs/PRIVACY.md, "Secure aggregation").

:class:`SecureRound` is what the round loop calls instead of ``Server.fit_round`` when
``secure-aggregation = true``: it hands Flower's ``SecAggPlusWorkflow`` the strategy
(``configure_fit`` samples and configures, ``aggregate_fit`` receives the sum) and
the round's global model, and returns the new one. Records, checkpoints and the
summary stay the round loop's, the same in both modes.

Two additions to Flower's workflow:

- :class:`ScreeningGrid` screens the masked replies with the strategy's checks BEFORE
  they are summed; a refused reply becomes an error reply, so the workflow treats its
  sender as dropped and removes its masks (its values never enter the sum);
- :class:`RoundBoundSecAggPlus` sets SecAgg+'s ``max_weight`` (the sample count that
  weighs 1) to the largest size declared by the round's clients, known only once the
  strategy has sampled them, so no honest weight exceeds 1 and the weights use the
  quantizer's full range.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from flwr.app import ConfigRecord, Context, Message
from flwr.common import FitRes, Parameters, bytes_to_ndarray, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.server_config import ServerConfig
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp.grid import Grid

from common import secure_prf
from common.config import RunConfig

from .failures import rejection
from .strategy import FedAvgStrategy

secure_prf.install()  # SecAgg+'s masks from a full-entropy PRF (flwr#7522)


@dataclass(frozen=True)
class Sender:
    """The sender of a reply whose node left the client manager meanwhile (the
    registry still knows its partition by its id)."""

    cid: str


def masked_reply(msg: Message) -> FitRes | None:
    """A collect-stage reply as a FitRes whose arrays are its masked vector (None for
    any other message): what :meth:`FedAvgStrategy.screen` checks before the sum."""
    if not msg.has_content():
        return None
    stage = msg.content.config_records.get(RECORD_KEY_CONFIGS, {})
    if Key.MASKED_PARAMETERS not in stage:
        return None
    fitres = compat.recorddict_to_fitres(msg.content, keep_input=True)
    masked = [bytes_to_ndarray(b) for b in stage[Key.MASKED_PARAMETERS]]
    fitres.parameters = ndarrays_to_parameters(masked)
    return fitres


class ScreeningGrid:
    """The grid the SecAgg+ workflow talks to: Flower's grid, except that the masked
    replies pass :meth:`FedAvgStrategy.screen` first and a refused one is turned into an
    error reply (code :data:`.failures.REJECTED`)."""

    def __init__(self, grid: Grid, strategy: FedAvgStrategy, client_manager: ClientManager,
                 server_round: int):
        self.grid = grid
        self.strategy = strategy
        self.client_manager = client_manager
        self.server_round = server_round

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> list[Message]:
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        masked = {id(m): res for m in replies if (res := masked_reply(m)) is not None}
        if not masked:
            return replies
        proxies = self.client_manager.all()
        results: list[tuple[ClientProxy, FitRes]] = [
            (proxies.get(str(m.metadata.src_node_id)) or Sender(str(m.metadata.src_node_id)),
             masked[id(m)]) for m in replies if id(m) in masked]
        accepted = {id(res) for _, res in self.strategy.screen(self.server_round, results)}
        return [m if id(m) not in masked or id(masked[id(m)]) in accepted
                else Message(error=rejection("refused before the sum (round record: "
                                             "rejected_reasons)"), metadata=m.metadata)
                for m in replies]


class RoundBoundSecAggPlus(SecAggPlusWorkflow):
    """Flower's SecAgg+ with ``max_weight`` = the strategy's ``weight_bound`` of the
    round (Flower reads it in its setup stage, after the strategy sampled the round)."""

    def __init__(self, strategy: FedAvgStrategy, cfg: RunConfig):
        self._strategy = strategy
        super().__init__(num_shares=cfg.num_shares or 1.0,  # 1.0: every client of the round
                         reconstruction_threshold=cfg.reconstruction_threshold,
                         clipping_range=cfg.clipping_range,
                         timeout=cfg.client_timeout or None)

    @property
    def max_weight(self) -> float:
        return float(self._strategy.weight_bound)

    @max_weight.setter
    def max_weight(self, value: float) -> None:
        """Flower's constructor sets a constant; the round's bound replaces it."""


class SecureRound:
    """``(round, global parameters) -> new parameters or None``: one SecAgg+ round."""

    def __init__(self, grid: Grid, context: Context, strategy: FedAvgStrategy,
                 client_manager: ClientManager, cfg: RunConfig):
        self.grid = grid
        self.strategy = strategy
        self.client_manager = client_manager
        self.workflow = RoundBoundSecAggPlus(strategy, cfg)
        self.context = LegacyContext(context, ServerConfig(num_rounds=cfg.rounds), strategy,
                                     client_manager)

    def __call__(self, server_round: int, parameters: Parameters) -> Parameters | None:
        state = self.context.state
        state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {WorkflowKey.CURRENT_ROUND: server_round, WorkflowKey.START_TIME: time.time()})
        before = compat.parameters_to_arrayrecord(parameters, keep_input=True)
        state.array_records[MAIN_PARAMS_RECORD] = before
        self.workflow(ScreeningGrid(self.grid, self.strategy, self.client_manager,
                                    server_round), self.context)
        self.strategy.note_halted(server_round)
        after = state.array_records[MAIN_PARAMS_RECORD]
        if after is before:  # halted, or the strategy kept the model
            return None
        return compat.arrayrecord_to_parameters(after, keep_input=True)
