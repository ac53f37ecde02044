"""One training round under secure aggregation: Flower's SecAgg+ workflow driving the
round's strategy (docs/PRIVACY.md, "Secure aggregation").

:class:`SecureRound` is what the round loop calls instead of ``Server.fit_round`` when
``secure-aggregation = true``: it hands Flower's ``SecAggPlusWorkflow`` the round's
:class:`.strategy.RoundStrategy` (``configure_fit`` gives the planned instructions,
``aggregate_fit`` receives the sum) and the global model. Records, checkpoints and the
summary stay the round loop's, the same in both modes.

Two additions to Flower's workflow:

- :class:`ScreeningGrid` screens the masked replies with the pipeline's checks BEFORE
  they are summed; a refused reply becomes an error reply, so the workflow treats its
  sender as dropped and removes its masks (its values never enter the sum);
- SecAgg+'s ``max_weight`` (the sample count that weighs 1) is the largest size declared
  by the round's clients (the plan's ``weight_bound``), so no honest weight exceeds 1
  and the weights use the quantizer's full range.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from logging import WARNING

from flwr.app import ConfigRecord, Context, Message
from flwr.common import FitRes, Parameters, bytes_to_ndarray, ndarrays_to_parameters
from flwr.common.logger import log
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
from .pipeline import RoundOutcome
from .strategy import RoundStrategy

secure_prf.install()  # SecAgg+'s masks from a full-entropy PRF (flwr#7522)


@dataclass(frozen=True)
class Sender:
    """The sender of a reply whose node left the client manager meanwhile (the
    registry still knows its partition by its id)."""

    cid: str


def masked_reply(msg: Message) -> FitRes | None:
    """A collect-stage reply as a FitRes whose arrays are its masked vector (None for
    any other message): what the screen step checks before the sum."""
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
    replies pass the round's screen first (:meth:`RoundStrategy.screen_masked`) and a
    refused one is turned into an error reply (code :data:`.failures.REJECTED`)."""

    def __init__(self, grid: Grid, strategy: RoundStrategy, client_manager: ClientManager):
        self.grid = grid
        self.strategy = strategy
        self.client_manager = client_manager

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
        accepted = {id(res) for _, res in self.strategy.screen_masked(results)}
        return [m if id(m) not in masked or id(masked[id(m)]) in accepted
                else Message(error=rejection("refused before the sum (round record: "
                                             "rejected_reasons)"), metadata=m.metadata)
                for m in replies]


class SecureRound:
    """``(round strategy, global parameters) -> the round's outcome``: one SecAgg+ round."""

    def __init__(self, grid: Grid, context: Context, client_manager: ClientManager,
                 cfg: RunConfig):
        self.grid = grid
        self.context = context
        self.client_manager = client_manager
        self.cfg = cfg

    def __call__(self, strategy: RoundStrategy, parameters: Parameters) -> RoundOutcome:
        """The round's outcome; a round SecAgg+ stopped before the sum (too few clients
        answered a stage to reconstruct the masks) keeps the global model."""
        plan, cfg = strategy.plan, self.cfg
        context = LegacyContext(self.context, ServerConfig(num_rounds=cfg.rounds), strategy,
                                self.client_manager)
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {WorkflowKey.CURRENT_ROUND: plan.round, WorkflowKey.START_TIME: time.time()})
        context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
            parameters, keep_input=True)
        workflow = SecAggPlusWorkflow(num_shares=cfg.num_shares or 1.0,  # 1.0: every client
                                      reconstruction_threshold=cfg.reconstruction_threshold,
                                      max_weight=float(plan.weight_bound),
                                      clipping_range=cfg.clipping_range,
                                      timeout=cfg.client_timeout or None)
        workflow(ScreeningGrid(self.grid, strategy, self.client_manager), context)
        if strategy.outcome is not None:
            return strategy.outcome
        log(WARNING, "round %d: secure aggregation halted (fewer clients than "
            "reconstruction-threshold answered a stage): global model kept", plan.round)
        screened = strategy.screened.record if strategy.screened else {}
        return RoundOutcome(None, {**screened, "n_clients": 0, "skipped": True,
                                   "secure_aggregation_halted": True})
