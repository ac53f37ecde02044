"""One client's work for one round: the received global model, its data and helpers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from common.config import RunConfig
from common.losses import cross_entropy
from common.step_capture import train_captured
from common.training import (
    BatchLoss,
    BatchTransform,
    LossFn,
    Optimizer,
    Regularizer,
    SGDSettings,
    TrainingSet,
    TrainStats,
    predict_proba,
    train,
    train_batches,
)
from common.transition import cross_fitted_accuracy

from .local_data import LocalData
from .node_state import load_vector

NOISE_MODEL = "noise-model"  # context.state: the Q this client trained with last (guarded runs)


@dataclass
class LocalJob:
    """Everything a method's local update needs; :attr:`probs` are the RECEIVED global
    model's predictions on the local data, computed the first time a method or the
    accuracy signal reads them, which must be before training changes the model (a job
    that reads none, FedAvg's, makes no prediction pass). ``phase`` is FedEFC's phase (1
    or 2) for the methods whose server has one, else None. Training leaves out the
    validation share (:attr:`held_back`)."""

    cfg: RunConfig
    local: LocalData
    model: nn.Module
    phase: int | None
    server_round: int
    seed: int
    state: object = None  # the node's persistent context.state (a RecordDict)
    config: dict = field(default_factory=dict)  # the round config the server sent
    transform: BatchTransform = field(init=False)
    generator: torch.Generator = field(init=False)
    _probs: np.ndarray | None = field(init=False, default=None)
    _trained: bool = field(init=False, default=False)  # has training touched self.model?
    last_q: np.ndarray | None = field(init=False, default=None)  # the matrix used, if any
    # the Q this client trained with in its previous round (None: cross-entropy, Q = I)
    prior_q: np.ndarray | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        device = self.local.x.device
        torch.manual_seed(self.seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.transform = BatchTransform.of(self.local.spec, device)
        k = self.local.data.task.num_classes
        prior = load_vector(self.state, NOISE_MODEL, k * k)
        self.prior_q = None if prior is None else prior.reshape(k, k)

    @property
    def probs(self) -> np.ndarray:
        """The received global model's softmax predictions on every local sample (eval
        mode, no augmentation; docs/FEDEFC.md §4), computed once, on first use. Read
        after training has begun they would be the trained model's: that is refused."""
        if self._probs is None:
            if self._trained:
                raise RuntimeError(
                    "LocalJob.probs read after training began: a local update must read the "
                    "received model's predictions before it trains (docs/FEDEFC.md §4)")
            self._probs = predict_proba(self.model, self.local.x, self.transform,
                                        self.cfg.eval_batch_size)
        return self._probs

    @property
    def labels(self) -> np.ndarray:
        return self.local.labels

    @property
    def device(self) -> torch.device:
        return self.local.x.device

    def settings(self) -> SGDSettings:
        c = self.cfg
        return SGDSettings(c.local_epochs, c.batch_size, c.lr, c.momentum, c.weight_decay,
                           c.precision)

    @property
    def guard_positions(self) -> np.ndarray | None:
        """The samples A_k is read on this round: the validation share, or its guard
        slice in phase 2 with ``validation-phase-2 = "guard-slice"`` (docs/FEDEFC.md
        §3.6); None without a share (:meth:`common.sample_roles.SampleRoles.guard`)."""
        return self.local.roles.guard(self.phase)

    @property
    def held_back(self) -> np.ndarray | None:
        """Positions not trained on in this round (docs/FEDEFC.md §3.1, §3.6, §3.7;
        :meth:`common.sample_roles.SampleRoles.held_back`)."""
        return self.local.roles.held_back(self.phase)

    def estimation_positions(self) -> np.ndarray:
        """The samples whose predictions estimate the client's noise matrix in phase 2:
        the validation share while it is kept out of training (``validation-phase-2 =
        "estimate"``: predictions the model did not fit, as cleanlab's out-of-sample
        probabilities are), its guard slice with ``"guard-slice"`` (§3.6), else all of
        the client's samples (docs/FEDEFC.md §4); beside a verified share, whose labels
        carry no noise to estimate, the estimation share or else the samples trained on
        (docs/FEDEFC.md §3.7; :meth:`common.sample_roles.SampleRoles.counted`)."""
        return self.local.roles.counted(self.phase)

    def trainable(self, keep: np.ndarray | None = None) -> np.ndarray | None:
        """The mask of the samples trained on: ``keep`` (all when None) less
        :attr:`held_back`; None when that is every sample."""
        held = self.held_back
        if held is None:
            return keep
        mask = np.ones(len(self.labels), dtype=bool) if keep is None else keep.copy()
        mask[held] = False
        return mask

    def global_accuracy(self) -> float:
        """Accuracy of the received global model on the local (observed) labels."""
        return float(np.mean(self.probs.argmax(1) == self.labels))

    def validation_accuracy(self) -> float:
        """Accuracy of the received global model on the validation share's observed
        labels (the ``held-out`` signal; in phase 2 with ``validation-phase-2 =
        "guard-slice"`` on its guard slice, docs/FEDEFC.md §3.6); a client too small for
        a share (one sample) gives :meth:`global_accuracy`. In phase 2 (the phase-2
        guard's signal, docs/FEDEFC.md §3.4) the model's prediction of an observed label
        is the argmax of ``Q p``, through the Q the client trained with in its previous
        round (:attr:`prior_q`; p itself after a round of cross-entropy), or with
        ``guard-score = "cross-fit"`` through a Q counted on the other half of the share
        from the same predictions (:func:`common.transition.cross_fitted_accuracy`).
        Verified labels (docs/FEDEFC.md §3.7) are true labels: the model's own argmax is
        scored."""
        val = self.guard_positions
        if val is None:
            return self.global_accuracy()
        probs = self.probs[val]
        # verified labels are true labels: the model is scored as it is (§3.7)
        if self.phase == 2 and not self.local.roles.verified:
            if self.cfg.guard_score == "cross-fit":
                return cross_fitted_accuracy(probs, self.labels[val], self.cfg.count_rule,
                                             self.cfg.weighting,
                                             self.cfg.q_estimator_mode == "shrunk")
            if self.prior_q is not None:
                probs = probs @ self.prior_q.T
        return float(np.mean(probs.argmax(1) == self.labels[val]))

    def anchor(self, model: nn.Module | None = None) -> list[torch.Tensor]:
        """Detached copies of the trainable parameters (the proximal terms' w_g)."""
        return [p.detach().clone() for p in (model or self.model).parameters()]

    def training_set(self, labels: np.ndarray | None = None,
                     keep: np.ndarray | None = None) -> TrainingSet:
        """The local samples with their observed labels (or ``labels``), all of them or
        those of the ``keep`` mask, less :attr:`held_back`."""
        x = self.local.x
        y = self.local.y if labels is None else torch.as_tensor(labels, device=self.device)
        keep = self.trainable(keep)
        if keep is not None:
            idx = torch.as_tensor(np.flatnonzero(keep), device=self.device)
            x, y = x.index_select(0, idx), y.index_select(0, idx)
        return TrainingSet(x, y, self.transform, self.local.spec.augment)

    def train(self, loss_fn: LossFn = cross_entropy, keep: np.ndarray | None = None,
              regularizer: Regularizer | None = None, model: nn.Module | None = None,
              labels: np.ndarray | None = None) -> TrainStats:
        """Local SGD with ``loss_fn`` (+ ``regularizer``) on :meth:`training_set`; its step
        replayed from a CUDA graph with ``step-capture = "cuda-graph"``
        (:mod:`common.step_capture`)."""
        self._trained = self._trained or model is None or model is self.model
        loop = train_captured if self.cfg.step_capture == "cuda-graph" else train
        return loop(model or self.model, self.training_set(labels, keep), loss_fn,
                    self.settings(), self.generator, regularizer)

    def train_batches(self, batch_loss: BatchLoss, optimizer: Optimizer) -> TrainStats:
        """Local training of ``self.model`` with a loss that sees the whole batch."""
        self._trained = True
        return train_batches(self.model, self.training_set(), batch_loss, optimizer,
                             self.settings(), self.generator)
