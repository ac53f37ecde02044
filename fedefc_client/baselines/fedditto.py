"""Ditto's local update (docs/BASELINE-METHODS.md, "FedAvg, FedProx, FedDitto").

The personalized model v lives in the node's ``context.state`` (a RecordDict kept by
Flower per node and run) and trains with CE + lambda/2 ||v - w_g||^2; the global model
trains as in FedAvg.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord

from common.baselines.fedditto import DittoMessages as M
from common.baselines.fedditto import DittoSettings, label_weighted_accuracy
from common.messages import FitReply
from common.runtime import model_for
from common.training import evaluate_per_class

from ..job import LocalJob
from ..local_update import Update
from .fedprox import proximal_term

PERSONAL = "ditto-personal"  # context.state: the personal model's state dict
UPDATES = "ditto-updates"  # context.state: how often it was trained


def fedditto(job: LocalJob) -> Update:
    """Train v, then the global model; report ``personal-acc``: v's accuracy on the clean
    test set weighted by this client's label distribution (its share of the test
    distribution), where the simulation knows that test set."""
    personal = model_for(job.cfg, job.local.data.task, job.device, slot="ditto")
    if PERSONAL in job.state:
        arrays = job.state[PERSONAL].to_torch_state_dict()
        personal.load_state_dict({k: v.to(job.device) for k, v in arrays.items()})
    else:
        personal.load_state_dict(job.model.state_dict())
    anchor, lam = job.anchor(), job.cfg.settings(DittoSettings).ditto_lambda
    job.train(regularizer=lambda m: lam * proximal_term(m, anchor), model=personal)
    job.state[PERSONAL] = ArrayRecord(
        torch_state_dict={k: v.detach().cpu() for k, v in personal.state_dict().items()})
    updates = int(job.state[UPDATES]["updates"]) + 1 if UPDATES in job.state else 1
    job.state[UPDATES] = ConfigRecord({"updates": updates})
    metrics = {FitReply.LOSS: "cross-entropy", M.PERSONAL_UPDATES: updates}
    test = job.local.test_split()
    if test is not None:
        per_class = evaluate_per_class(personal, *test, job.transform,
                                       job.local.data.num_classes, job.cfg.eval_batch_size)
        metrics[M.PERSONAL_ACC] = label_weighted_accuracy(per_class, job.labels)
    return len(job.labels), metrics, job.train()

