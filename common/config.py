"""The run configuration: the keys every run has, validated from Flower's flat run config.

Flower hands the ServerApp and every ClientApp the same flat ``run_config`` dict
(hyphenated keys, TOML scalar values). :class:`RunConfig` holds the keys every method
shares; a method with keys of its own (FedProx's ``mu``, FedCorr's ``fedcorr-*``, ...)
validates them with its own :class:`MethodSettings` model, kept beside its math in
``common/baselines/``. :func:`common.methods.load_run_config` puts the two together;
every error names the key, the value given and what is allowed (:class:`ConfigError`).
The defaults are the decisions of docs/FEDEFC.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ConfigError as ConfigError  # its home; every importer finds it here
from .faults import parse_faults, parse_server_faults
from .fedefc_plan import (
    TWIN_MODELS,
    accuracy_signal_mode,
    check_variant,
    clients_per_round,
    phase_2_guard_mode,
    q_estimator_mode,
    q_pooling_mode,
    twin_mode,
)
from .named_datasets import DATASETS

# datasets whose files the user brings (docs/OWN-DATA.md); the others are registered by
# name (common/named_datasets.py)
OWN_DATASETS = ("npz", "imagefolder")
# a model given by import path: "package.module:callable" (docs/OWN-DATA.md, "Your model")
MODEL_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
EVALUATIONS = ("auto", "server", "federated", "both")
# the phase-1 accuracy a client reports (docs/FEDEFC.md §3.1)
ACCURACY_SIGNALS = ("auto", "global", "held-out", "local-train")
# how a FedEFC client's count matrices make its Q in phase 2 (docs/FEDEFC.md §4.7)
Q_POOLINGS = ("auto", "none", "cumulative")
# how a column of counts becomes a column of Q (docs/FEDEFC.md §4.8)
Q_ESTIMATORS = ("auto", "counted", "shrunk")
# the phase-2 guard: the held-out accuracy watched after the switch (docs/FEDEFC.md §3.4)
PHASE_2_GUARDS = ("auto", "on", "off")
# SecAgg+ sums quantized values below 2**22 modulo 2**32 (Flower's defaults): more than
# 2**10 clients in one sum could overflow (docs/PRIVACY.md, "Secure aggregation").
SECAGG_MAX_CLIENTS = 1024


def secagg_shares(num_shares: int, threshold: float, clients: int) -> tuple[int, int]:
    """(shares, reconstruction threshold) of a SecAgg+ round of ``clients`` clients, as
    Flower 1.42's setup stage computes them from ``num-shares`` (0: every client, which
    the workflow receives as the fraction 1.0, so round(1.0 x clients) = clients) and
    ``reconstruction-threshold`` t: threshold = max(round(t x shares), 2)
    (docs/PRIVACY.md, "Who can rebuild a secret")."""
    shares = num_shares or clients
    return shares, max(round(threshold * shares), 2)


def is_strict_majority(threshold: int, shares: int, clients: int) -> bool:
    """Whether ``threshold`` shares are more than half of a secret's holders (the
    ``min(shares, clients)`` clients that hold one): only then can no server that asks
    one half of the holders for a client's mask seed and the other half for its key
    reconstruct both (docs/PRIVACY.md, "Who can rebuild a secret")."""
    return 2 * threshold > min(shares, clients)


def hyphenate(name: str) -> str:
    """A field name as its run-config key (``num_clients`` -> ``num-clients``)."""
    return name.replace("_", "-")


FLAT_KEYS = ConfigDict(extra="forbid", alias_generator=hyphenate, populate_by_name=True,
                       frozen=True)


class NoiseGroup(BaseModel):
    """One group of clients sharing a noise setting (docs/FEDEFC.md §1.2)."""

    rho: float
    zeta: float


class RunConfig(BaseModel):
    """Every key a run has whatever its method (declared with its default in pyproject.toml)."""

    model_config = FLAT_KEYS

    method: str = "fedefc"  # a name of common/methods.py: METHODS, checked by load_run_config
    dataset: str = "mnist-embedded"
    data_dir: str = ""
    download: bool = False
    model: str = "auto"
    # own data (docs/OWN-DATA.md)
    data_path: str = ""
    test_path: str = ""
    num_classes: int = Field(0, ge=0, le=1_000_000)
    input_shape: str = ""
    normalization: str = "auto"
    augment: Literal["auto", "none", "crop-flip"] = "auto"
    evaluation: Literal[EVALUATIONS] = "auto"  # type: ignore[valid-type]
    local_test_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    num_clients: int = Field(20, ge=1, le=100_000)
    fraction: float = Field(0.5, gt=0.0, le=1.0)
    rounds: int = Field(40, ge=1, le=100_000)
    local_epochs: int = Field(5, ge=1, le=1000)
    batch_size: int = Field(32, ge=1, le=65536)
    lr: float = Field(0.03, gt=0.0, le=10.0)
    momentum: float = Field(0.5, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    iid: bool = False
    alpha_dir: float = Field(10.0, gt=0.0, le=1e6)
    p: float = Field(0.5, gt=0.0, le=1.0)
    rho: float = Field(0.2, ge=0.0, lt=1.0)
    zeta: float = Field(0.8, ge=0.0, le=1.0)
    noise_groups: str = ""
    noise_seed: int = Field(-1, ge=-1, le=2**31 - 1)  # -1: derived from seed
    noise_draw: Literal["project", "reference"] = "project"
    prestopping: bool = True
    start_round: int = Field(5, ge=0)
    gamma_thr: int = Field(3, ge=1, le=100_000)
    # a rise of A(t) counts only above this many standard errors (docs/FEDEFC.md §3.3);
    # 0: the paper's rule; "auto": 1 where the validation shares are large, else 0
    prestopping_min_gain: float | Literal["auto"] = "auto"
    accuracy_signal: Literal[ACCURACY_SIGNALS] = "auto"  # type: ignore[valid-type]
    validation_fraction: float = Field(0.4, gt=0.0, lt=1.0)
    validation_max_per_class: int = Field(0, ge=0, le=1_000_000)  # 0: no cap
    # in phase 2 the share stays out of training ("estimate"), is trained on ("train"),
    # or is trained on but for a guard slice, its half that the guard reads and Q is
    # counted on ("guard-slice"; docs/FEDEFC.md §3.6)
    validation_phase_2: Literal["estimate", "train", "guard-slice"] = "estimate"
    # "verified": the share's labels are checked ones, so A(t) is a clean accuracy
    # (docs/FEDEFC.md §3.7)
    validation_labels: Literal["observed", "verified"] = "observed"
    # verified labels only: the share of the other samples kept out of training, on whose
    # predictions Q is counted (0: Q from the samples trained on; docs/FEDEFC.md §3.7)
    estimation_share: float = Field(0.0, ge=0.0, lt=1.0)
    # what the phase-2 guard does when it fires: end the run, or (verified labels only)
    # restore the best model and train on with cross-entropy (docs/FEDEFC.md §3.7)
    guard_fallback: Literal["end", "train"] = "end"
    # how the phase-2 guard reads a model on observed labels: through the Q the client
    # trained with last round, or through a Q counted on the other half of the share
    # (docs/FEDEFC.md §3.4)
    guard_score: Literal["prior-q", "cross-fit"] = "prior-q"
    # the coordinator's clean validation set the phase-2 guard reads (docs/FEDEFC.md §3.9):
    # a file on the ServerApp's machine, or N per class drawn in a simulation
    clean_validation_path: str = ""
    clean_validation_per_class: int = Field(0, ge=0, le=100_000)
    # a method without a guard (FedAvg, FedProx, FedDitto) with the coordinator's clean
    # set: deliver the last model ("final"), or the model that reads best on the set where
    # the set can tell it from the last ("best-read": the phase-2 guard's delivered-model
    # rule, docs/FEDEFC.md §3.4, §3.9)
    deliver: Literal["final", "best-read"] = "final"
    q_pooling: Literal[Q_POOLINGS] = "auto"  # type: ignore[valid-type]
    q_estimator: Literal[Q_ESTIMATORS] = "auto"  # type: ignore[valid-type]
    phase_2_guard: Literal[PHASE_2_GUARDS] = "auto"  # type: ignore[valid-type]
    # FedEFC's clients also train a twin of the global model on all their data, the model
    # the run delivers (docs/FEDEFC.md §3.8); "auto": where the held-out signal keeps a share
    twin_model: Literal[TWIN_MODELS] = "auto"  # type: ignore[valid-type]
    count_rule: Literal["cleanlab", "cleanlab-present", "masked", "paper"] = "cleanlab"
    weighting: Literal["none", "label-prior"] = "none"
    seed: int = Field(0, ge=0, le=2**31 - 1)
    out_dir: str = ""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16"] = "fp32"
    step_capture: Literal["off", "cuda-graph"] = "off"  # common/step_capture.py
    client_threads: int = Field(0, ge=0, le=1024)
    diagnostics: bool = True
    eval_batch_size: int = Field(1024, ge=1, le=1_000_000)
    # reliability (docs/RELIABILITY.md)
    resume_from: str = ""
    min_fit_clients: int = Field(1, ge=1, le=100_000)
    client_timeout: float = Field(0.0, ge=0.0, le=1e6)
    wait_for_nodes: float = Field(300.0, gt=0.0, le=86400.0)
    # a partition that misses more than this share of the training rounds makes the run
    # "degraded" (docs/RELIABILITY.md, "A missing site is named"); 1.0: never
    max_missed_share: float = Field(0.1, ge=0.0, le=1.0)
    accuracy_aggregation: Literal["mean", "median", "trimmed-mean"] = "mean"
    trim_fraction: float = Field(0.1, ge=0.0, lt=0.5)
    max_client_samples: int = Field(0, ge=0)
    faults: str = ""
    server_faults: str = ""  # a dishonest server's modes (docs/THREAT-MODEL.md)
    # privacy (docs/PRIVACY.md)
    secure_aggregation: bool = False
    min_secure_clients: int = Field(3, ge=2, le=SECAGG_MAX_CLIENTS)
    num_shares: int = Field(0, ge=0, le=SECAGG_MAX_CLIENTS)
    reconstruction_threshold: float = Field(0.67, gt=0.5, le=1.0)
    clipping_range: float = Field(8.0, gt=0.0, le=1e6)
    secure_groups: int = Field(1, ge=1, le=SECAGG_MAX_CLIENTS)
    dp_clip: float = Field(0.0, ge=0.0, le=1e6)
    dp_noise_multiplier: float = Field(0.0, ge=0.0, le=1e6)
    dp_delta: float = Field(1e-5, gt=0.0, lt=1.0)  # the delta of the reported epsilon
    max_update_norm: float = Field(0.0, ge=0.0)
    # a secure run without dp-clip or max-update-norm: every client clips its update to
    # this times the initial model's norm (common/update_bound.py: round_bound); 0: none
    secure_update_bound: float = Field(1.0, ge=0.0, le=1e6)
    audit: bool = False
    # identity (docs/THREAT-MODEL.md, "Identity and partitions")
    allowlist: str = ""
    # a deployment without an allowlist: refused unless the coordinator opts out here
    open_deployment: bool = False

    # every method's settings, set by parse_run_config (one instance per settings model)
    _settings: dict[type, MethodSettings] = PrivateAttr(default_factory=dict)
    # the run's entry of the method registry (common/methods.py: a Method, typed Any here
    # so that the two modules do not import each other), set at validation by
    # parse_run_config: the facts a method declares (whether it trains a twin, ...)
    _method: Any = PrivateAttr(default=None)

    @field_validator("prestopping_min_gain", mode="before")
    @classmethod
    def _standard_errors(cls, value: Any) -> float | str:
        if value == "auto":
            return value
        try:
            gain = float(value)
        except (TypeError, ValueError):
            gain = -1.0
        if not 0.0 <= gain <= 10.0:
            raise ValueError("give \"auto\" (the default) or a number of standard errors from "
                             "0 (the paper's rule) to 10")
        return gain

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, name: str) -> str:
        if name not in DATASETS and name not in OWN_DATASETS:
            raise ValueError(f"unknown dataset; use one of "
                             f"{', '.join([*DATASETS, *OWN_DATASETS])}")
        return name

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> RunConfig:
        self._method = (info.context or {}).get("methods", {}).get(self.method)
        if self.dataset in DATASETS and DATASETS[self.dataset].reads_data_dir and \
                not os.path.isabs(self.data_dir):
            raise ValueError(
                f"data-dir={self.data_dir!r}: dataset {self.dataset!r} needs an absolute "
                "folder in torchvision's layout (the app runs from Flower's app "
                "directory, so relative paths break); e.g. data-dir=\"/data\""
            )
        self._check_own_data()
        if self.resume_from and not os.path.isabs(self.resume_from):
            raise ValueError(
                f"resume-from={self.resume_from!r} is not absolute; give the absolute out-dir "
                "of the run to continue"
            )
        parse_faults(self.faults)
        parse_server_faults(self.server_faults)
        if self.min_fit_clients > self.clients_per_round:
            raise ValueError(
                f"min-fit-clients={self.min_fit_clients} exceeds the "
                f"{self.clients_per_round} clients sampled per round; "
                "lower it or raise fraction"
            )
        if self.out_dir and not os.path.isabs(self.out_dir):
            raise ValueError(
                f"out-dir={self.out_dir!r} is not absolute; give an absolute path "
                "(Flower runs the app from its own working directory)"
            )
        for group in self.noise_group_list():
            _check_noise(group.rho, group.zeta, "noise-groups")
        if self.noise_draw == "reference" and len(self.noise_group_list()) > 1:
            raise ValueError(
                f"noise-draw='reference' draws one noise matrix for the whole training set, "
                f"but noise-groups={self.noise_groups!r} asks for several; use "
                "noise-draw='project' with noise-groups")
        _check_noise(self.rho, self.zeta, "rho/zeta")
        if int(self.num_clients * self.fraction) < 1:
            raise ValueError(
                f"fraction={self.fraction} with num-clients={self.num_clients} samples "
                "no client per round; raise fraction to at least 1/num-clients"
            )
        self._check_privacy()
        check_variant(self)
        self._check_clean_validation()
        if self.prestopping and self.start_round >= self.rounds:
            raise ValueError(
                f"start-round={self.start_round} is not below rounds={self.rounds}: "
                "prestopping could never trigger; lower start-round or set prestopping=false"
            )
        return self

    def _check_clean_validation(self) -> None:
        """The coordinator's clean validation set (docs/FEDEFC.md §3.9): one source, an
        absolute path, and no other way for the guard to read the clients' shares (who
        reads the set, a method's guard or its server, :func:`common.methods._check_method`
        decides)."""
        path, per_class = self.clean_validation_path, self.clean_validation_per_class
        if not (path or per_class):
            return
        if path and per_class:
            raise ValueError(
                f"clean-validation-path={path!r} and clean-validation-per-class={per_class} "
                "are two sources of the coordinator's clean validation set: give the file "
                "(a deployment) or the number per class a simulation draws, not both")
        key = self.clean_validation_key
        if path and not os.path.isabs(path):
            raise ValueError(f"{key} is not absolute; give the absolute path of the .npz "
                             "file (or ImageFolder directory) on the ServerApp's machine")
        if path and self.dataset in OWN_DATASETS and not (self.data_path or self.test_path):
            raise ValueError(
                f"{key} on a server that holds neither data-path nor test-path: the server "
                "reads its clean set as it reads the coordinator's test set, with the "
                "normalization the nodes share; set test-path and normalization "
                "(docs/OWN-DATA.md, \"The coordinator's clean test set\")")
        if per_class and self.dataset in OWN_DATASETS and not self.data_path:
            raise ValueError(
                f"{key} draws the set from the run's training data, which this server "
                "does not hold (no data-path: the nodes bring their own); give "
                "clean-validation-path, a file of checked samples on this machine")

    @property
    def clean_validation_key(self) -> str:
        """The key that gives the coordinator's clean validation set, with its value, as
        the refusals name it ("" without a set)."""
        if self.clean_validation_path:
            return f"clean-validation-path={self.clean_validation_path!r}"
        if self.clean_validation_per_class:
            return f"clean-validation-per-class={self.clean_validation_per_class}"
        return ""

    @property
    def guard_reads_clean(self) -> bool:
        """Whether the phase-2 guard reads checked labels: the clients' verified shares
        (docs/FEDEFC.md §3.7) or the coordinator's clean validation set (§3.9)."""
        return self.validation_labels == "verified" or bool(self.clean_validation_key)

    def _check_own_data(self) -> None:
        """The keys of docs/OWN-DATA.md: paths, shapes, model, evaluation."""
        if self.model != "auto" and not MODEL_PATH.match(self.model):
            from .models import MODELS  # lazy: torch, 1.1 s of CPU, for a model named here

            if self.model not in MODELS:
                raise ValueError(
                    f"model={self.model!r} is neither a built-in model (auto, "
                    f"{', '.join(MODELS)}) nor "
                    "an import path; write model=\"package.module:callable\"")
        for key, value in (("data-path", self.data_path), ("test-path", self.test_path)):
            if value and not os.path.isabs(value):
                raise ValueError(f"{key}={value!r} is not absolute; give the absolute path of "
                                 "an .npz file or an ImageFolder directory (the app runs from "
                                 "Flower's app directory)")
        parse_input_shape(self.input_shape)
        parse_normalization(self.normalization)
        own = self.dataset in OWN_DATASETS
        if not own:
            for key, value in (("data-path", self.data_path), ("test-path", self.test_path),
                               ("input-shape", self.input_shape)):
                if value:
                    raise ValueError(
                        f"{key}={value!r} is for dataset=\"npz\" or \"imagefolder\"; "
                        f"dataset {self.dataset!r} has its own files and split: leave {key} "
                        "empty, or set dataset=\"npz\" / \"imagefolder\"")
        elif self.data_dir:
            raise ValueError(f"data-dir={self.data_dir!r} is the torchvision folder of mnist "
                             f"and cifar; dataset {self.dataset!r} reads data-path (and "
                             "test-path): set those and leave data-dir empty")
        if own and not self.data_path:
            self._check_sites_data()
        if self.evaluation in ("server", "both") and not self.has_test_set:
            raise ValueError(
                f"evaluation={self.evaluation!r} needs a server test set, and dataset "
                f"{self.dataset!r} without test-path has none: set test-path, or "
                "evaluation=\"federated\" (the clients evaluate on their held-out data)")
        if self.federated_evaluation and self.local_test_fraction <= 0.0:
            raise ValueError(
                f"local-test-fraction={self.local_test_fraction}: federated evaluation needs "
                "held-out data on every client; set it in (0, 1), e.g. 0.2")

    def _check_sites_data(self) -> None:
        """Own data without ``data-path``: a deployment whose nodes bring their own data.
        The server then holds no data (``evaluation = "federated"``) or only the
        coordinator's test set (``test-path``, docs/OWN-DATA.md, "The coordinator's
        clean test set"); either way K and the input shape come from the run config, and
        a server test set needs a normalization the nodes share."""
        if self.test_path and self.num_classes and self.input_shape:
            if self.normalization == "auto":
                raise ValueError(
                    f"test-path={self.test_path!r} without data-path: the server evaluates "
                    "on the coordinator's test set while each node would standardize its "
                    "inputs by its own data (normalization=\"auto\"), so the model would see "
                    "the test set on another scale; give the normalization every node and "
                    "the server share, e.g. normalization=\"0.5,0.5,0.5;0.25,0.25,0.25\" "
                    "(images, pixel/255) or normalization=\"none\"")
            return
        if self.evaluation == "federated" and self.num_classes and self.input_shape:
            return
        raise ValueError(
            f"dataset={self.dataset!r} needs data-path: the absolute path of the training "
            "data (an .npz or an ImageFolder directory). Only a deployment whose nodes "
            "each bring their own data-path may leave it empty, and then the server needs "
            "num-classes and input-shape, and either evaluation=\"federated\" (it holds "
            "no data) or test-path, the coordinator's test set, with a normalization the "
            "nodes share")

    @property
    def has_test_set(self) -> bool:
        """Whether the server has a test set: the paper's datasets, or a test-path."""
        return self.dataset not in OWN_DATASETS or bool(self.test_path)

    @property
    def evaluation_mode(self) -> str:
        """``server``, ``federated`` or ``both``; ``auto`` is ``server`` when a test set
        exists, else ``federated``."""
        if self.evaluation != "auto":
            return self.evaluation
        return "server" if self.has_test_set else "federated"

    @property
    def accuracy_signal_mode(self) -> str:
        return accuracy_signal_mode(self.accuracy_signal, self.num_clients, self.fraction,
                                    self.prestopping)

    @property
    def q_pooling_mode(self) -> str:
        return q_pooling_mode(self.q_pooling, self.num_clients, self.fraction)

    @property
    def q_estimator_mode(self) -> str:
        return q_estimator_mode(self.q_estimator, self.num_clients, self.fraction)

    @property
    def phase_2_guard_mode(self) -> str:
        return phase_2_guard_mode(self.phase_2_guard, self.accuracy_signal_mode)

    @property
    def min_gain_setting(self) -> float | str:
        """``prestopping-min-gain`` where the run keeps validation shares (the held-out
        signal), else 0: the paper's rule (docs/FEDEFC.md §3.3)."""
        return self.prestopping_min_gain if self.accuracy_signal_mode == "held-out" else 0.0

    @property
    def method_entry(self) -> Any:
        """The run's ``Method`` entry (common/methods.py: METHODS), None for a name the
        registry does not hold (``load_run_config`` refuses it)."""
        return self._method

    @property
    def twinned(self) -> bool:
        """Whether FedEFC's clients train a twin on all their data (docs/FEDEFC.md §3.8)."""
        return twin_mode(self) == "on"

    @property
    def guarded(self) -> bool:
        """Whether the phase-2 guard watches this run (docs/FEDEFC.md §3.4)."""
        return self.prestopping and self.phase_2_guard_mode == "on"

    @property
    def server_evaluation(self) -> bool:
        return self.evaluation_mode in ("server", "both")

    @property
    def federated_evaluation(self) -> bool:
        return self.evaluation_mode in ("federated", "both")
    def _check_privacy(self) -> None:
        """The privacy keys against each other and the round size (docs/PRIVACY.md)."""
        if self.dp_noise_multiplier > 0 and self.dp_clip == 0:
            raise ValueError(
                f"dp-noise-multiplier={self.dp_noise_multiplier} needs dp-clip > 0: the noise "
                "is a multiple of the clipping norm; set dp-clip, e.g. dp-clip=1.0")
        if self.allowlist and not os.path.isabs(self.allowlist):
            raise ValueError(
                f"allowlist={self.allowlist!r} is not absolute; give the absolute path of the "
                "operator's allowlist file on the machine that runs the ServerApp "
                "(docs/THREAT-MODEL.md, \"Identity and partitions\")")
        if self.allowlist and self.open_deployment:
            raise ValueError(
                f"open-deployment=true and allowlist={self.allowlist!r} contradict: "
                "open-deployment runs a deployment without an allowlist; set one of them "
                "(docs/THREAT-MODEL.md, \"Identity and partitions\")")
        if self.audit and not (self.out_dir or self.resume_from):
            raise ValueError(
                "audit=true needs out-dir: every client writes its audit log under "
                "<out-dir>/audit; set out-dir")
        if not self.secure_aggregation:
            if self.secure_groups > 1:
                raise ValueError(
                    f"secure-groups={self.secure_groups} needs secure-aggregation=true: it "
                    "splits a secure round's clients into separately masked sums; set "
                    "secure-groups=1 or secure-aggregation=true")
            return
        if self.federated_evaluation:
            raise ValueError(
                f"secure-aggregation=true with evaluation={self.evaluation_mode!r}: each "
                "client's evaluate reply carries its held-out loss and accuracy in the "
                "clear, which secure aggregation is meant to hide; use evaluation=\"server\" "
                "(with a test set: test-path for own data) or secure-aggregation=false")
        m = self.clients_per_round
        if not 2 <= m <= SECAGG_MAX_CLIENTS:
            raise ValueError(
                f"secure-aggregation=true with {m} clients per round: SecAgg+ sums the "
                f"updates of 2..{SECAGG_MAX_CLIENTS} clients; change fraction or num-clients")
        if m < self.min_secure_clients:
            raise ValueError(
                f"secure-aggregation=true with {m} clients per round, below "
                f"min-secure-clients={self.min_secure_clients}: a sum of so few updates "
                "tells each of them (and a server colluding with one) the others'; raise "
                "fraction or num-clients")
        if self.num_shares and not 3 <= self.num_shares <= m:
            raise ValueError(
                f"num-shares={self.num_shares}: a client's secrets go to 3..{m} (the clients "
                "per round) clients, or to all of them with num-shares=0")
        if self.num_shares and self.num_shares < m and self.num_shares % 2 == 0:
            raise ValueError(
                f"num-shares={self.num_shares} is even: Flower 1.42's SecAgg+ then gives each "
                "client one neighbour more than it makes shares for, and the round fails; "
                f"use an odd number, e.g. num-shares={self.num_shares + 1}")
        if m // self.secure_groups < self.min_secure_clients:
            raise ValueError(
                f"secure-groups={self.secure_groups} with {m} clients per round gives groups "
                f"of {m // self.secure_groups}, below min-secure-clients="
                f"{self.min_secure_clients}: each group's sum must hide its clients; lower "
                "secure-groups or raise fraction or num-clients")
        for clients in range(self.min_secure_clients, m + 1):
            shares, threshold = secagg_shares(self.num_shares, self.reconstruction_threshold,
                                              clients)
            if not is_strict_majority(threshold, shares, clients):
                raise ValueError(
                    f"reconstruction-threshold={self.reconstruction_threshold}: a round of "
                    f"{clients} clients would need only {threshold} of {min(shares, clients)} "
                    "shares to rebuild a secret, not a strict majority, so a server could "
                    "rebuild both secrets of one client and unmask its update; raise it "
                    "(0.67 holds for any round size)")
        if self.accuracy_aggregation == "median" and self.secure_groups < 3:
            raise ValueError(
                "accuracy-aggregation='median' under secure aggregation is the median of "
                f"the groups' mean accuracies, and secure-groups={self.secure_groups} gives "
                "fewer than 3 groups; set secure-groups >= 3 (an odd number) or "
                "accuracy-aggregation=\"mean\"")
        if self.accuracy_aggregation == "trimmed-mean":
            raise ValueError(
                "accuracy-aggregation='trimmed-mean' needs every client's accuracy, which "
                "secure aggregation hides (the server learns only sums); use "
                "accuracy-aggregation=\"mean\", or \"median\" with secure-groups >= 3")

    @property
    def clients_per_round(self) -> int:
        return clients_per_round(self.num_clients, self.fraction)

    def noise_group_list(self) -> list[NoiseGroup]:
        """Parse ``noise-groups`` ("rho:zeta;rho:zeta"); empty means one group (rho, zeta)."""
        text = self.noise_groups.strip()
        if not text:
            return [NoiseGroup(rho=self.rho, zeta=self.zeta)]
        groups = []
        for part in text.split(";"):
            try:
                rho_s, zeta_s = part.split(":")
                groups.append(NoiseGroup(rho=float(rho_s), zeta=float(zeta_s)))
            except ValueError:
                raise ValueError(
                    f"noise-groups={self.noise_groups!r}: group {part!r} is not 'rho:zeta'; "
                    "write e.g. noise-groups=\"0.2:0.4;0.4:0.8\""
                ) from None
        if len(groups) > self.num_clients:
            raise ValueError(
                f"noise-groups has {len(groups)} groups but num-clients={self.num_clients}; "
                "use at most one group per client"
            )
        return groups

    def resolved_model(self, input_shape: tuple[int, ...]) -> str:
        """The model name, with ``auto`` resolved: a named dataset's registered model
        (docs/FEDEFC.md §2.2); for own data ``cnn`` on images and ``mlp`` on feature
        vectors."""
        if self.model != "auto":
            return self.model
        if self.dataset in DATASETS:
            return DATASETS[self.dataset].model
        return "cnn" if len(input_shape) == 3 else "mlp"

    def settings(self, model: type[S]) -> S:
        """This run's values of a method's own keys (validated by ``model``)."""
        return self._settings[model]  # type: ignore[return-value]

    def to_flat(self) -> dict[str, Any]:
        """The flat, hyphenated form Flower uses (what ``config.json`` stores): the
        shared keys, then every method's own keys."""
        flat = self.model_dump(by_alias=True)
        for settings in self._settings.values():
            flat.update(settings.model_dump(by_alias=True))
        return flat

    def recorded(self) -> dict[str, Any]:
        """:meth:`to_flat` as a run records it (``config.json``, the checkpoint), with
        ``twin-model`` as the clients trained it, "on" or "off": what ``auto`` does has
        changed once (docs/FEDEFC.md §3.8), and a record must say what ran
        (:func:`common.methods.as_recorded` reads the records written before)."""
        return {**self.to_flat(), "twin-model": twin_mode(self)}

    def data_key(self) -> str:
        """A digest of every key that decides the clients' data (partition and noise)."""
        keys = ("dataset", "data-dir", "data-path", "num-classes", "input-shape",
                "normalization", "augment", "num-clients", "iid", "alpha-dir", "p", "rho",
                "zeta", "noise-groups", "noise-seed", "noise-draw", "seed")
        flat = self.model_dump(by_alias=True)
        if self.clean_validation_per_class:  # the coordinator's draw leaves the clients
            keys += ("clean-validation-per-class",)
        blob = json.dumps({k: flat[k] for k in keys}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class MethodSettings(BaseModel):
    """The run-config keys of one method, validated by the method's own model.

    A subclass declares its fields (hyphenated as keys: ``fedcorr_beta`` is
    ``fedcorr-beta``) and may check them against the shared keys of a run that uses
    the method (:meth:`check`, raising ValueError with the keys and the fix).
    """

    model_config = FLAT_KEYS

    def check(self, cfg: RunConfig) -> None:
        """Cross-checks with the shared keys, for a run of this method (none by default)."""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.alias or n for n, f in cls.model_fields.items())


S = TypeVar("S", bound=MethodSettings)


def parse_input_shape(text: str) -> tuple[int, ...] | None:
    """``input-shape``: "CxHxW" for images, "D" for feature vectors; "" is None (taken
    from the data)."""
    if not text.strip():
        return None
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) not in (1, 3) or min(shape) < 1:
        raise ValueError(f"input-shape={text!r} is not 'CxHxW' (images, e.g. \"3x32x32\") "
                         "or 'D' (feature vectors, e.g. \"13\")")
    return shape


def parse_normalization(text: str) -> tuple[tuple[float, ...], tuple[float, ...]] | str:
    """``normalization``: "auto", "none", or "MEANS;STDS" with one comma-separated value
    per channel (images, in units of pixel/255) or per feature."""
    if text in ("auto", "none"):
        return text
    try:
        means, stds = (tuple(float(v) for v in part.split(",")) for part in text.split(";"))
    except ValueError:
        means, stds = (), ()
    if not means or len(means) != len(stds) or min(stds) <= 0:
        raise ValueError(f"normalization={text!r} is not \"auto\", \"none\" or "
                         "\"MEANS;STDS\" with as many positive stds as means, e.g. "
                         "\"0.49,0.48,0.45;0.25,0.24,0.26\"")
    return means, stds


def _check_noise(rho: float, zeta: float, key: str) -> None:
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"{key}: rho={rho} must be in [0, 1)")
    if not 0.0 <= zeta <= 1.0:
        raise ValueError(f"{key}: zeta={zeta} must be in [0, 1]")
    if zeta == 1.0 and rho > 0.0:
        raise ValueError(
            f"{key}: zeta=1 (no off-diagonal noise rate) contradicts rho={rho}>0; "
            "use zeta<1, or rho=0 for clean labels"
        )


# Keys a run config no longer has: {key: (the value that asks for what every run now
# does, what became of the key)}. The config.json and checkpoint of a run made while the
# key existed hold that value, which is dropped, so the run can still be read and
# resumed; any other value asked for the removed path and is refused.
RETIRED_KEYS = {
    "stacked-clients": (0, (
        "removed: a simulation's clients sent in groups to one node and stepped together "
        "ran 1.9x to 2.7x slower per round than one message per client on a GPU, and 22 % "
        "slower on a CPU (docs/BENCHMARKS.md, \"Removed: clients stepped together\"); every "
        "run now sends one message per client: delete the key")),
}


def retired(given: dict[str, Any]) -> list[str]:
    """Drop the :data:`RETIRED_KEYS` from ``given`` (in place); the refusals of those
    given another value than the one every run now has."""
    errors = []
    for key, (kept, why) in RETIRED_KEYS.items():
        value = given.pop(key, kept)
        if value != kept:
            errors.append(f"run-config key {key!r} = {value!r}: {why}")
    return errors


def parse_run_config(flat: Mapping[str, Any], methods: Mapping[str, Any]) -> RunConfig:
    """Validate Flower's flat run config: the shared keys with :class:`RunConfig`, each
    method's keys with its model (``methods``: the registry, name -> ``Method`` of
    common/methods.py, whose ``settings`` is its model or None, and whose facts the
    rules read: :attr:`RunConfig.method_entry`); raise :class:`ConfigError` naming every
    bad key."""
    given = dict(flat)
    settings_of = {name: method.settings for name, method in methods.items()}
    models = list(dict.fromkeys(m for m in settings_of.values() if m is not None))
    owner = {key: model for model in models for key in model.keys()}
    errors: list[str] = retired(given)
    cfg = None
    try:
        cfg = RunConfig.model_validate({k: v for k, v in given.items() if k not in owner},
                                       context={"methods": methods})
    except ValidationError as err:
        errors += _format_errors(err, given, known=[*_keys(RunConfig), *owner])
    settings: dict[type, MethodSettings] = {}
    for model in models:
        try:
            settings[model] = model.model_validate(
                {k: v for k, v in given.items() if owner.get(k) is model})
        except ValidationError as err:
            errors += _format_errors(err, given, known=[])
    if errors:
        raise ConfigError("; ".join(errors))
    own = settings_of.get(cfg.method)
    if own is not None:
        try:
            settings[own].check(cfg)
        except ValueError as err:
            raise ConfigError(f"run config: {err}") from None
    cfg._settings = settings
    return cfg


def _keys(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def _format_errors(err: ValidationError, given: dict[str, Any], known: list[str]) -> list[str]:
    lines = []
    for item in err.errors():
        loc = ".".join(str(x) for x in item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown run-config key {loc!r}; known keys: "
                         f"{', '.join(sorted(known))}")
            continue
        msg = item["msg"].removeprefix("Value error, ")
        if loc:
            lines.append(f"run-config key {loc!r} = {given.get(loc)!r}: {msg}")
        else:
            lines.append(f"run config: {msg}")
    return lines


def config_differences(stored: dict[str, Any], wanted: dict[str, Any], defaults: dict[str, Any],
                       ignore: frozenset[str] = frozenset()) -> dict[str, tuple[Any, Any]]:
    """Keys whose value differs between a stored resolved config and a wanted one.

    A key missing from ``stored`` (it did not exist when that run was made) counts as its
    default, so adding a key with a behaviour-preserving default does not orphan older
    results or checkpoints.
    """
    return {k: (stored.get(k, defaults.get(k)), v) for k, v in wanted.items()
            if k not in ignore and stored.get(k, defaults.get(k)) != v}
