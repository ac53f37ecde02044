"""The methods, each declared once (docs/ARCHITECTURE.md, "A new method"), and the run
config that selects one.

A :class:`Method` entry names everything the rest of the project needs to know about a
method: its server (the hooks its ServerApp adds to the round pipeline) and its local
update (what its ClientApp trains), as import paths that each app resolves for itself
(the two apps never import each other, and ``common`` imports neither); its own
run-config keys (a :class:`MethodSettings` model); the metrics its training replies
carry; whether it can run under secure aggregation and differential privacy; whether an
interrupted run resumes exactly. The round pipeline, the reply checks, the launcher's
preflight, the grid runner, the report and the docs' tables all read :data:`METHODS`.

:func:`load_run_config` validates the shared keys and every method's keys, so a bad
``fedcorr-beta`` fails whatever the method; a run config is validated once per process
and the result shared (:func:`load_run_config` caches it).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any

from .baselines.confident_learning import ConfidentLearningMessages
from .baselines.fedcorr import FedCorrMessages, FedCorrSettings
from .baselines.fedditto import DittoMessages, DittoSettings
from .baselines.fednoro import FedNoRoSettings
from .baselines.fedprox import FedProxSettings
from .baselines.forward_correction import ForwardCorrectionSettings
from .baselines.rofl import RoFLMessages, RoFLSettings
from .config import ConfigError, MethodSettings, RunConfig, config_differences, parse_run_config
from .fedefc_plan import (
    accuracy_signal_mode,
    phase_2_guard_mode,
    q_estimator_mode,
    q_pooling_mode,
    twin_mode,
)
from .messages import ReplyMetric


@dataclass(frozen=True)
class Method:
    """One method (docs/BASELINE-METHODS.md describes every one).

    ``server``: ``"module:Class"`` of its server hooks in ``fedefc_server`` (a
    ``MethodServer``); ``local_update``: ``"module:function"`` of its local update in
    ``fedefc_client`` (a function of a ``LocalJob``). ``reply``: the metrics its training
    replies carry beyond the core's. ``per_client_values``: what its server needs of
    every single client beyond sums (non-empty: the run refuses secure aggregation, which
    would hide them, and differential privacy, which would leave them without noise).
    ``exact_resume``: its clients keep nothing across rounds, so a run resumed from a
    checkpoint ends as the uninterrupted run (docs/RELIABILITY.md). ``counts_subset``: a
    reply counts only the samples it trained on (at most the declared size).
    ``needs_features``: its local update needs the model's penultimate features.
    ``counts_q``: its local update counts FedEFC's Q, so ``q-pooling`` and ``q-estimator``
    apply to it: it sums its phase-2 count matrices over rounds in the node's state where
    ``q-pooling`` resolves to ``cumulative`` (docs/FEDEFC.md §4.7) and shrinks Q towards
    the identity where ``q-estimator`` resolves to ``shrunk`` (§4.8). ``twin``: its
    clients can also train a twin of the global model on all their data, the model the
    run delivers (``twin-model``, docs/FEDEFC.md §3.8)."""

    name: str
    title: str
    server: str
    local_update: str
    settings: type[MethodSettings] | None = None
    reply: tuple[ReplyMetric, ...] = ()
    per_client_values: str = ""
    exact_resume: bool = True
    counts_subset: bool = False
    needs_features: bool = False
    counts_q: bool = False
    twin: bool = False

    @property
    def secure(self) -> bool:
        """Whether the method can run under secure aggregation and DP."""
        return not self.per_client_values

    @property
    def prestopping(self) -> bool:
        """Whether its server is FedEFC's prestopping server (a phase 1 with the clients'
        accuracy signal, then the switch)."""
        return self.server == _PRESTOPPING


_SERVERS = "fedefc_server"
_CLIENTS = "fedefc_client"
_PRESTOPPING = f"{_SERVERS}.prestopping_server:PrestoppingServer"
_PLAIN = f"{_SERVERS}.method_server:MethodServer"

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("fedefc", "FedEFC", _PRESTOPPING, f"{_CLIENTS}.local_update:fedefc",
           counts_q=True, twin=True),
    Method("fedavg", "FedAvg", _PLAIN, f"{_CLIENTS}.local_update:fedavg"),
    Method("fedprox", "FedProx", _PLAIN, f"{_CLIENTS}.baselines.fedprox:fedprox",
           FedProxSettings),
    Method("fedditto", "FedDitto", _PLAIN, f"{_CLIENTS}.baselines.fedditto:fedditto",
           DittoSettings,
           reply=(ReplyMetric(DittoMessages.PERSONAL_ACC),
                  ReplyMetric(DittoMessages.PERSONAL_UPDATES, "count", ("per-client",))),
           exact_resume=False),  # the personal models live in the nodes' state
    Method("forward-correction", "forward correction", _PRESTOPPING,
           f"{_CLIENTS}.baselines.forward_correction:forward_correction",
           ForwardCorrectionSettings),
    Method("confident-learning", "confident learning", _PRESTOPPING,
           f"{_CLIENTS}.baselines.confident_learning:confident_learning",
           reply=tuple(ReplyMetric(k, "count", ("sum",)) for k in (
               ConfidentLearningMessages.KEPT, ConfidentLearningMessages.REMOVED)),
           counts_subset=True),  # the kept count
    Method("fedcorr", "FedCorr", f"{_SERVERS}.baselines.fedcorr:FedCorrServer",
           f"{_CLIENTS}.baselines.fedcorr:fedcorr", FedCorrSettings,
           reply=(ReplyMetric(FedCorrMessages.LID, fold=()),  # its server records them
                  ReplyMetric(FedCorrMessages.EST_NOISE, fold=())),
           per_client_values="fits a mixture on each client's LID and keeps each client's "
                             "noise estimate",
           exact_resume=False),  # the corrected labels live in the nodes' state
    Method("fednoro", "FedNoRo", f"{_SERVERS}.baselines.fednoro:FedNoRoServer",
           f"{_CLIENTS}.baselines.fednoro:fednoro", FedNoRoSettings,
           per_client_values="clusters each client's per-class losses and weights each "
                             "client's model by its distance"),
    Method("rofl", "RoFL", f"{_SERVERS}.baselines.rofl:RoFLServer",
           f"{_CLIENTS}.baselines.rofl:rofl", RoFLSettings,
           reply=tuple(ReplyMetric(k, "count", ("sum",))
                       for k in (RoFLMessages.KEPT, RoFLMessages.AGREE, RoFLMessages.REPLACED)),
           per_client_values="weights each client's class centroids by their similarity "
                             "to the global ones",
           needs_features=True),
)}


def method_of(cfg: RunConfig) -> Method:
    """The run's method entry."""
    return METHODS[cfg.method]


def load_object(path: str) -> Any:
    """The object an entry names as ``"module:attribute"`` (a method's server or local
    update), imported in the app that runs it."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _check_method(cfg: RunConfig) -> None:
    """The run's method against the registry: its name, secure aggregation / DP, and the
    coordinator's clean validation set (a phase-2 guard's)."""
    method = METHODS.get(cfg.method)
    if method is None:
        raise ConfigError(f"run-config key 'method' = {cfg.method!r}: unknown method; use one "
                          f"of {', '.join(METHODS)}")
    if not method.secure and (cfg.secure_aggregation or cfg.dp_clip):
        raise ConfigError(
            f"run config: method {cfg.method!r} needs every client's own values (its "
            f"server {method.per_client_values}): secure aggregation would hide them and "
            "differential privacy would leave them without noise; run it with "
            "secure-aggregation=false and dp-clip=0")
    if cfg.clean_validation_key:
        _check_clean_set(cfg, method)
    if cfg.deliver == "best-read" and (method.prestopping or method.server != _PLAIN
                                       or not cfg.clean_validation_key):
        why = ("FedEFC's phase-2 guard already delivers the model that reads best (docs/"
               "FEDEFC.md §3.4)" if method.prestopping else
               "the model that reads best is read on the coordinator's clean set, and "
               "this run has none: give clean-validation-path (or, in a simulation, "
               "clean-validation-per-class)" if method.server == _PLAIN else
               f"method {cfg.method!r} has server steps of its own")
        raise ConfigError(f"run config: deliver=\"best-read\" with method {cfg.method!r}: "
                          f"{why}; set deliver=\"final\"")


def _check_clean_set(cfg: RunConfig, method: Method) -> None:
    """Who reads the coordinator's clean validation set (docs/FEDEFC.md §3.9): the phase-2
    guard of a prestopping method, which the run must have; the server of a method
    without server steps of its own, which reports each round's model on it."""
    key = cfg.clean_validation_key
    if method.prestopping and not cfg.guarded:
        raise ConfigError(
            f"{key}: the coordinator's clean validation set is read by the phase-2 "
            f"guard, and this run has none (method {cfg.method!r}, phase-2-guard="
            f"{cfg.phase_2_guard!r}, accuracy-signal resolved "
            f"{cfg.accuracy_signal_mode!r}): the guard watches FedEFC where every client "
            "trains in every round (docs/FEDEFC.md §3.4); leave the key empty, or turn "
            "the guard on")
    if not method.prestopping and method.server != _PLAIN:
        raise ConfigError(
            f"run config: {key} with method {cfg.method!r}: the coordinator's clean "
            "validation set is read by the phase-2 guard of the prestopping methods and "
            "reported each round by the methods without server steps of their own "
            f"({', '.join(m.name for m in METHODS.values() if m.server == _PLAIN)}); "
            f"{cfg.method!r} has its own server steps: leave both keys empty for it")


_PARSED: dict[frozenset, RunConfig] = {}
_LAST: list = [None, None]  # a copy of the last run-config dict, and its RunConfig
_LOCK = threading.Lock()


def load_run_config(flat: dict[str, Any]) -> RunConfig:
    """Validate Flower's flat run config; raise ConfigError naming each bad key. The
    result is cached per process (the config is frozen), so the ClientApp and each of
    its mods share one validation per run instead of one per message."""
    with _LOCK:
        last_flat, last_cfg = _LAST
        if flat == last_flat:  # one comparison, no hashing: a message's mods ask alike
            return last_cfg
        key = frozenset(flat.items())
        cfg = _PARSED.get(key)
    if cfg is None:
        cfg = parse_run_config(flat, METHODS)
        _check_method(cfg)
    with _LOCK:
        _PARSED[key] = cfg
        _LAST[:] = [dict(flat), cfg]
    return cfg


def validation_share(cfg: RunConfig) -> float:
    """The fraction of its training data each client keeps out of training for the
    accuracy signal: ``validation-fraction`` for a prestopping method with the
    ``held-out`` signal, else 0 (no share; docs/FEDEFC.md §3.1)."""
    return cfg.validation_fraction if keeps_share(cfg.method, cfg.accuracy_signal_mode) else 0.0


def keeps_share(method: str, signal_mode: str) -> bool:
    """Whether a run of ``method`` whose accuracy signal resolves to ``signal_mode`` keeps
    a validation share: a prestopping method with the ``held-out`` signal (the one home
    of the rule; docs/FEDEFC.md §3.1)."""
    entry = METHODS.get(method)
    return entry is not None and entry.prestopping and signal_mode == "held-out"


def pooling_used(method: str, pooling_mode: str) -> str:
    """The ``q-pooling`` a run of ``method`` whose pooling resolves to ``pooling_mode``
    actually does: ``none`` for a method that does not pool (docs/FEDEFC.md §4.7)."""
    entry = METHODS.get(method)
    return pooling_mode if entry is not None and entry.counts_q else "none"


def counts_pooling(cfg: RunConfig) -> str:
    """The pooling the run's clients do: ``q-pooling`` resolved, ``none`` for a method
    that does not pool (docs/FEDEFC.md §4.7)."""
    return pooling_used(cfg.method, cfg.q_pooling_mode)


def estimator_used(method: str, estimator_mode: str) -> str:
    """The ``q-estimator`` a run of ``method`` whose estimator resolves to
    ``estimator_mode`` actually uses: ``counted`` for a method that does not count
    FedEFC's Q (docs/FEDEFC.md §4.8)."""
    entry = METHODS.get(method)
    return estimator_mode if entry is not None and entry.counts_q else "counted"


def q_estimator_used(cfg: RunConfig) -> str:
    """The estimator the run's clients use: ``q-estimator`` resolved (:func:`estimator_used`)."""
    return estimator_used(cfg.method, cfg.q_estimator_mode)


def shortest_useful_run(cfg: RunConfig) -> int:
    """The fewest rounds in which a prestopping run can find its T_e and judge a phase 2
    (docs/FEDEFC.md §3.5): ``start-round``; gamma_thr rounds in which A(t) can still
    rise (the plateau); A_max and gamma_thr rounds of patience, so T_e; then gamma_thr + 1
    phase-2 rounds (the guard judges a phase-2 model from round T_e + 2 on, gamma_thr of
    them)."""
    return cfg.start_round + 3 * cfg.gamma_thr + 2


def short_run_warning(cfg: RunConfig) -> str | None:
    """What to tell before a prestopping run shorter than :func:`shortest_useful_run`
    starts (None when it is long enough, or the run has no prestopping): "too few" where
    even the earliest T_e leaves fewer than gamma_thr + 1 phase-2 rounds, else that its
    phase 2 needs A(t) to stop rising at once (docs/FEDEFC.md §3.5)."""
    if not (method_of(cfg).prestopping and cfg.prestopping):
        return None
    least = shortest_useful_run(cfg)
    if cfg.rounds >= least:
        return None
    earliest = cfg.start_round + cfg.gamma_thr + 1
    why = (f"T_e can come at round {earliest} at the earliest (start-round="
           f"{cfg.start_round}, then A_max and gamma-thr={cfg.gamma_thr} rounds of patience)")
    budget = (f"a run that leaves gamma-thr rounds for A(t) to level and gamma-thr + 1 "
              f"phase-2 rounds to judge the correction needs rounds >= {least} "
              "(docs/FEDEFC.md §3.5)")
    if cfg.rounds >= earliest + cfg.gamma_thr + 1:
        return (f"rounds={cfg.rounds} leaves {cfg.method} a phase 2 only if A(t) stops "
                f"rising at once: {why}, phase 2 then from round {earliest + 1}; {budget}. "
                "If A(t) rises longer, the run stays in phase 1 (it then trains as FedAvg)")
    return (f"rounds={cfg.rounds} is too few for {cfg.method}'s phase 2: {why}, and only "
            f"if A(t) stops rising at once; {budget}. With fewer, expect a run that never "
            "leaves phase 1 (it then trains as FedAvg): raise rounds, or lower start-round "
            "or gamma-thr")


def resumes_exactly(cfg: RunConfig) -> bool:
    """Whether a run resumed from a checkpoint ends as the uninterrupted one: its clients
    keep nothing across rounds (``Method.exact_resume``, and no pooled counts: a resumed
    run's nodes start with an empty ``context.state``; docs/RELIABILITY.md)."""
    return method_of(cfg).exact_resume and counts_pooling(cfg) == "none"


def default_config() -> dict[str, Any]:
    """Every run-config key with its default, flat."""
    return load_run_config({}).to_flat()


# What a stored run without a key did: the behaviour from before the key existed.
BEFORE_THE_KEY = {"accuracy-signal": "global", "q-pooling": "none", "q-estimator": "counted",
                  "phase-2-guard": "off", "validation-max-per-class": 0,
                  "prestopping-min-gain": 0.0, "twin-model": "off"}


def as_recorded(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored config as the run it records. Runs record the twin they trained ("on" or
    "off", :meth:`RunConfig.recorded`); one that recorded ``twin-model = "auto"`` ran
    before ``auto`` trained a twin with verified labels (docs/FEDEFC.md §3.8), so with
    ``validation-labels = "verified"`` it trained none."""
    if stored.get("twin-model") == "auto" and stored.get("validation-labels") == "verified":
        return {**stored, "twin-model": "off"}
    return stored


def changed_keys(stored: dict[str, Any], wanted: dict[str, Any],
                 ignore: frozenset[str] = frozenset()) -> dict[str, tuple[Any, Any]]:
    """{key: (stored, wanted)} where a stored resolved config differs from a wanted one;
    a key the stored config lacks counts as its default (:func:`config_differences`),
    except the keys of :data:`BEFORE_THE_KEY`, which count as what a run did before them.
    The keys with an ``auto`` compare by what they resolve to: ``accuracy-signal`` by
    the signal (a run stored with ``global`` is today's ``auto`` wherever ``auto``
    resolves to the paper's signal; a method without prestopping uses none),
    ``q-pooling`` and ``q-estimator`` by what the run's clients do (:func:`pooling_used`,
    :func:`estimator_used`), ``phase-2-guard`` by whether the guard watched;
    ``validation-fraction`` and ``validation-max-per-class`` by the share they set aside
    (0 wherever no share is kept), so a changed default orphans only the runs that kept
    one; ``prestopping-min-gain`` by its setting where a share is kept (0 without one;
    a recorded run whose T_e another setting leaves unchanged is that setting's run too,
    which only its records can tell: ``fedefc_server/prestopping_replay.py``);
    ``twin-model`` by whether the clients trained a twin (docs/FEDEFC.md §3.8; a stored
    ``auto`` as :func:`as_recorded` reads it)."""
    defaults = default_config()
    return config_differences(_resolved(as_recorded(stored), BEFORE_THE_KEY, defaults),
                              _resolved(wanted, defaults, defaults), defaults, ignore)


def _resolved(config: dict[str, Any], missing: dict[str, Any],
              defaults: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its ``auto`` keys resolved (a key it lacks taken from ``missing``)
    and its validation share as the share it keeps (0 where it keeps none)."""
    def value(key: str) -> Any:
        return config.get(key, defaults[key])

    def given(key: str) -> Any:
        return config.get(key, missing[key])
    clients, fraction = int(value("num-clients")), float(value("fraction"))
    prestopping = bool(value("prestopping"))
    signal = accuracy_signal_mode(given("accuracy-signal"), clients, fraction, prestopping)
    method = str(value("method"))
    pooling = q_pooling_mode(given("q-pooling"), clients, fraction)
    estimator = q_estimator_mode(given("q-estimator"), clients, fraction)
    guard = phase_2_guard_mode(given("phase-2-guard"), signal)
    kept = keeps_share(method, signal)
    entry = METHODS.get(method)
    twin = given("twin-model")
    if twin == "auto":  # read, not validated: a stored config is compared as is
        cfg = RunConfig.model_construct(**{k.replace("-", "_"): v for k, v in {
            **defaults, **config, "twin-model": twin}.items()})
        cfg._method = entry
        twin = twin_mode(cfg)
    return {**config, "accuracy-signal": signal if entry is None or entry.prestopping else "",
            "twin-model": twin,
            "q-pooling": pooling_used(method, pooling),
            "q-estimator": estimator_used(method, estimator),
            "phase-2-guard": guard if prestopping and keeps_share(method, signal) else "off",
            "validation-fraction": float(value("validation-fraction")) if kept else 0.0,
            "validation-max-per-class": int(given("validation-max-per-class")) if kept else 0,
            "prestopping-min-gain": _gain(given("prestopping-min-gain")) if kept else 0.0}


def _gain(setting: Any) -> float | str:
    """A ``prestopping-min-gain`` as the config holds it: ``auto`` or a number."""
    return setting if setting == "auto" else float(setting)
