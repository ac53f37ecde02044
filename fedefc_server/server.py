"""Flower's legacy round loop, able to start at a later round (resuming a checkpoint)."""

from __future__ import annotations

import timeit
from logging import INFO

from flwr.common.logger import log
from flwr.server import Server
from flwr.server.client_manager import ClientManager
from flwr.server.history import History
from flwr.server.strategy import Strategy


class ResumableServer(Server):
    """``Server.fit`` from round ``first_round`` on: fit, aggregate and evaluate each round
    (no federated evaluation: the strategy evaluates centrally on the test set).

    The strategy sees absolute round numbers, so sampling and client seeds, which are
    pure functions of (seed, round), continue exactly where the interrupted run stopped.
    """

    def __init__(self, *, client_manager: ClientManager, strategy: Strategy, first_round: int = 1):
        super().__init__(client_manager=client_manager, strategy=strategy)
        self.first_round = first_round

    def fit(self, num_rounds: int, timeout: float | None) -> tuple[History, float]:
        history = History()
        self.parameters = self._get_initial_parameters(self.first_round - 1, timeout)
        if self.first_round == 1:
            self._evaluate(0, history)
        else:
            log(INFO, "resuming at round %d of %d", self.first_round, num_rounds)
        start = timeit.default_timer()
        for server_round in range(self.first_round, num_rounds + 1):
            result = self.fit_round(server_round=server_round, timeout=timeout)
            if result is not None and result[0] is not None:
                self.parameters = result[0]
            self._evaluate(server_round, history)
        return history, timeit.default_timer() - start

    def _evaluate(self, server_round: int, history: History) -> None:
        result = self.strategy.evaluate(server_round, parameters=self.parameters)
        if result is not None:
            history.add_loss_centralized(server_round=server_round, loss=result[0])
            history.add_metrics_centralized(server_round=server_round, metrics=result[1])
