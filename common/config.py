"""The run configuration: one validated object built from Flower's flat run config.

Flower hands the ServerApp and every ClientApp the same flat ``run_config`` dict
(hyphenated keys, TOML scalar values). :func:`load_run_config` turns it into a
:class:`RunConfig`, or raises :class:`ConfigError` with a message that names
the key, the value given and what is allowed. The decisions of
``ALGORITHM.md`` (sections 1-4) are the defaults.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .faults import parse_faults
from .fedcorr import plan_fedcorr

DATASETS = ("mnist-embedded", "mnist", "cifar10", "cifar100")
MODELS = ("auto", "lenet", "cnn9", "resnet18", "resnet34")
METHODS = ("fedefc", "fedavg", "fedprox", "fedditto", "forward-correction",
           "confident-learning", "fedcorr", "fednoro", "rofl")


class ConfigError(ValueError):
    """A run-config key has an invalid value; the message names key, value and fix."""


def _alias(name: str) -> str:
    return name.replace("_", "-")


class NoiseGroup(BaseModel):
    """One group of clients sharing a noise setting (ALGORITHM.md section 1)."""

    rho: float
    zeta: float


class RunConfig(BaseModel):
    """Every run-config key of the app (declared with its default in pyproject.toml)."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=_alias, populate_by_name=True, frozen=True
    )

    method: Literal[METHODS] = "fedefc"  # type: ignore[valid-type]
    dataset: Literal[DATASETS] = "mnist-embedded"  # type: ignore[valid-type]
    data_dir: str = ""
    download: bool = False
    model: Literal[MODELS] = "auto"  # type: ignore[valid-type]
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
    prestopping: bool = True
    start_round: int = Field(5, ge=0)
    gamma_thr: int = Field(3, ge=1, le=100_000)
    accuracy_signal: Literal["global", "local-train"] = "global"
    count_rule: Literal["cleanlab", "masked", "paper"] = "cleanlab"
    weighting: Literal["none", "label-prior"] = "none"
    seed: int = Field(0, ge=0, le=2**31 - 1)
    out_dir: str = ""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    client_threads: int = Field(0, ge=0, le=1024)
    diagnostics: bool = True
    eval_batch_size: int = Field(1024, ge=1, le=1_000_000)
    # reliability (docs/RELIABILITY.md)
    resume_from: str = ""
    min_fit_clients: int = Field(1, ge=1, le=100_000)
    client_timeout: float = Field(0.0, ge=0.0, le=1e6)
    accuracy_aggregation: Literal["mean", "median", "trimmed-mean"] = "mean"
    trim_fraction: float = Field(0.1, ge=0.0, lt=0.5)
    max_client_samples: int = Field(0, ge=0)
    faults: str = ""
    mu: float = Field(1e-5, ge=0.0, le=1e4)
    ditto_lambda: float = Field(0.1, ge=0.0, le=1e4)
    fc_percentile: float = Field(97.0, ge=0.0, le=100.0)
    # noise-robust baselines (docs/BASELINES.md; defaults: the references')
    fedcorr_iterations: int = Field(5, ge=1, le=1000)
    fedcorr_frac1: float = Field(0.0, ge=0.0, le=1.0)  # 0: the run's fraction
    fedcorr_beta: float = Field(5.0, ge=0.0, le=1e4)
    fedcorr_lid_k: int = Field(20, ge=1, le=10_000)
    fedcorr_relabel_ratio: float = Field(0.5, ge=0.0, le=1.0)
    fedcorr_confidence_thres: float = Field(0.5, ge=0.0, le=1.0)
    fedcorr_clean_set_thres: float = Field(0.1, ge=0.0, le=1.0)
    fedcorr_finetune_share: float = Field(0.5, ge=0.0, le=1.0)
    fednoro_warmup: int = Field(10, ge=1, le=100_000)
    fednoro_kd_begin: int = Field(10, ge=0, le=100_000)
    fednoro_kd_end: int = Field(49, ge=0, le=100_000)
    fednoro_kd_weight: float = Field(0.8, ge=0.0, le=1.0)
    fednoro_temperature: float = Field(0.8, gt=0.0, le=100.0)
    fednoro_gmm_votes: int = Field(9, ge=1, le=1000)
    fednoro_optimizer: Literal["sgd", "adam"] = "sgd"
    fednoro_adam_lr: float = Field(3e-4, gt=0.0, le=10.0)
    fednoro_adam_weight_decay: float = Field(5e-4, ge=0.0, le=1.0)
    rofl_forget_rate: float = Field(0.2, ge=0.0, lt=1.0)
    rofl_num_gradual: int = Field(10, ge=1, le=100_000)
    rofl_t_pl: int = Field(100, ge=1, le=100_000)
    rofl_lambda_cen: float = Field(1.0, ge=0.0, le=1e4)
    rofl_lambda_e: float = Field(0.8, ge=0.0, le=1e4)
    rofl_detach_centroid_feature: bool = False  # true: the reimplementation's no-gradient term

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        if self.dataset != "mnist-embedded" and not os.path.isabs(self.data_dir):
            raise ValueError(
                f"data-dir={self.data_dir!r}: dataset {self.dataset!r} needs an absolute "
                "folder in torchvision's layout (the app runs from Flower's app "
                "directory, so relative paths break); e.g. data-dir=\"/data\""
            )
        if self.resume_from and not os.path.isabs(self.resume_from):
            raise ValueError(
                f"resume-from={self.resume_from!r} is not absolute; give the absolute out-dir "
                "of the run to continue"
            )
        parse_faults(self.faults)
        if self.min_fit_clients > max(1, int(self.num_clients * self.fraction)):
            raise ValueError(
                f"min-fit-clients={self.min_fit_clients} exceeds the "
                f"{max(1, int(self.num_clients * self.fraction))} clients sampled per round; "
                "lower it or raise fraction"
            )
        if self.out_dir and not os.path.isabs(self.out_dir):
            raise ValueError(
                f"out-dir={self.out_dir!r} is not absolute; give an absolute path "
                "(Flower runs the app from its own working directory)"
            )
        for group in self.noise_group_list():
            _check_noise(group.rho, group.zeta, "noise-groups")
        _check_noise(self.rho, self.zeta, "rho/zeta")
        if int(self.num_clients * self.fraction) < 1:
            raise ValueError(
                f"fraction={self.fraction} with num-clients={self.num_clients} samples "
                "no client per round; raise fraction to at least 1/num-clients"
            )
        if self.prestopping and self.start_round >= self.rounds:
            raise ValueError(
                f"start-round={self.start_round} is not below rounds={self.rounds}: "
                "prestopping could never trigger; lower start-round or set prestopping=false"
            )
        _check_noise_robust(self)
        return self

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

    def resolved_model(self) -> str:
        """The model name, with ``auto`` resolved by dataset (ALGORITHM.md section 2)."""
        if self.model != "auto":
            return self.model
        return {
            "mnist-embedded": "lenet",
            "mnist": "cnn9",
            "cifar10": "resnet18",
            "cifar100": "resnet34",
        }[self.dataset]

    def to_flat(self) -> dict[str, Any]:
        """The flat, hyphenated form Flower uses (what ``config.json`` stores)."""
        return self.model_dump(by_alias=True)

    def data_key(self) -> str:
        """A digest of every key that decides the clients' data (partition and noise)."""
        keys = ("dataset", "data-dir", "num-clients", "iid", "alpha-dir", "p", "rho",
                "zeta", "noise-groups", "seed")
        flat = self.to_flat()
        blob = json.dumps({k: flat[k] for k in keys}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


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


def _check_noise_robust(cfg: RunConfig) -> None:
    """The noise-robust baselines' schedules must fit in ``rounds``."""
    if cfg.method == "fedcorr":
        plan_fedcorr(cfg.rounds, cfg.num_clients, cfg.fraction, cfg.fedcorr_frac1,
                     cfg.fedcorr_iterations, cfg.fedcorr_finetune_share)
    if cfg.method == "fednoro" and cfg.fednoro_warmup >= cfg.rounds:
        raise ValueError(
            f"fednoro-warmup={cfg.fednoro_warmup} is not below rounds={cfg.rounds}: the "
            "noisy-client detection would never run; lower fednoro-warmup or raise rounds"
        )


def config_differences(stored: dict[str, Any], wanted: dict[str, Any],
                       ignore: frozenset[str] = frozenset()) -> dict[str, tuple[Any, Any]]:
    """Keys whose value differs between a stored resolved config and a wanted one.

    A key missing from ``stored`` (it did not exist when that run was made) counts as its
    default, so adding a key with a behaviour-preserving default does not orphan older
    results or checkpoints.
    """
    defaults = RunConfig().to_flat()
    return {k: (stored.get(k, defaults.get(k)), v) for k, v in wanted.items()
            if k not in ignore and stored.get(k, defaults.get(k)) != v}


def _format_errors(err: ValidationError, given: dict[str, Any]) -> str:
    lines = []
    for item in err.errors():
        loc = ".".join(str(x) for x in item["loc"])
        if item["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(RunConfig.model_fields[n].alias or n
                                       for n in RunConfig.model_fields))
            lines.append(f"unknown run-config key {loc!r}; known keys: {allowed}")
            continue
        msg = item["msg"].removeprefix("Value error, ")
        if loc:
            lines.append(f"run-config key {loc!r} = {given.get(loc)!r}: {msg}")
        else:
            lines.append(f"run config: {msg}")
    return "; ".join(lines)


def load_run_config(flat: dict[str, Any]) -> RunConfig:
    """Validate Flower's flat run config; raise :class:`ConfigError` naming each bad key."""
    try:
        return RunConfig.model_validate(dict(flat))
    except ValidationError as err:
        raise ConfigError(_format_errors(err, dict(flat))) from None
