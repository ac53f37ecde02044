"""FedEFC's variant in one place: its ``"auto"`` rules and the checks among its options
(docs/FEDEFC.md §3.1-§3.9, §4.7, §4.8).

Every ``"auto"`` of FedEFC's options hinges on one fact, whether every client trains in
every round (:func:`every_round`): there the paper's accuracy signal measures
memorization, so a validation share is kept (the held-out signal), and with it the
phase-2 guard, the twin, pooled counts and the shrunk Q. :func:`check_variant` refuses
the combinations of options that cannot run, each naming the fix. :class:`RunConfig`'s
properties (``accuracy_signal_mode``, ``twinned``, ``guarded``, ...) read these rules.
"""

from __future__ import annotations

from typing import Any

# the functions below read a common.config.RunConfig (which reads them: typed Any here,
# so that the two modules do not import each other)
RunConfig = Any

TWIN_MODELS = ("auto", "on", "off")


def clients_per_round(num_clients: int, fraction: float) -> int:
    """max(1, int(fraction * N)): the clients a round samples."""
    return max(1, int(num_clients * fraction))


def every_round(num_clients: int, fraction: float) -> bool:
    """Whether every client trains in every round: the fact the ``"auto"`` rules read."""
    return clients_per_round(num_clients, fraction) == num_clients


def accuracy_signal_mode(signal: str, num_clients: int, fraction: float,
                         prestopping: bool) -> str:
    """``global``, ``held-out`` or ``local-train``; ``auto`` is ``held-out`` when every
    client trains in every round and prestopping is on (the paper's signal then measures
    memorization and never fires), else ``global``, the paper's (docs/FEDEFC.md §3.1)."""
    if signal != "auto":
        return signal
    return "held-out" if every_round(num_clients, fraction) and prestopping else "global"


def q_pooling_mode(pooling: str, num_clients: int, fraction: float) -> str:
    """``none`` (each phase-2 round's counts alone: the paper) or ``cumulative`` (the
    client's counts summed over its phase-2 rounds); ``auto`` is ``cumulative`` when every
    client trains in every round, so its rounds' global models follow one another, else
    ``none`` (docs/FEDEFC.md §4.7)."""
    if pooling != "auto":
        return pooling
    return "cumulative" if every_round(num_clients, fraction) else "none"


def q_estimator_mode(estimator: str, num_clients: int, fraction: float) -> str:
    """``counted`` (each column of counts normalized: the paper) or ``shrunk`` (each
    column pulled towards the identity as far as its evidence is thin); ``auto`` is
    ``shrunk`` when every client trains in every round, else ``counted``
    (docs/FEDEFC.md §4.8)."""
    if estimator != "auto":
        return estimator
    return "shrunk" if every_round(num_clients, fraction) else "counted"


def phase_2_guard_mode(guard: str, signal_mode: str) -> str:
    """``on`` or ``off``; ``auto`` is ``on`` exactly where the run's accuracy signal is
    ``held-out`` (the share the guard measures on; docs/FEDEFC.md §3.4)."""
    if guard != "auto":
        return guard
    return "on" if signal_mode == "held-out" else "off"


def twin_obstacle(cfg: RunConfig) -> str:
    """Why this run cannot train a twin (docs/FEDEFC.md §3.8; '' when it can)."""
    if cfg.method_entry is None or not cfg.method_entry.twin:
        return (f"the twin trains FedEFC's phase 2 with each client's Q, and method "
                f"{cfg.method!r} has no such phase")
    if cfg.accuracy_signal_mode != "held-out":
        return (f"the twin is trained on the validation share that the held-out signal "
                f"keeps out of training, and accuracy-signal={cfg.accuracy_signal!r} "
                f"(here {cfg.accuracy_signal_mode!r}) keeps none")
    if not cfg.prestopping:
        return "prestopping=false never reaches phase 2, where the twin differs from FedAvg"
    if cfg.validation_phase_2 != "estimate":
        return (f"the twin keeps half the share out of training for the guard to read it, "
                f"and validation-phase-2={cfg.validation_phase_2!r} trains on the share "
                "in phase 2")
    if cfg.dp_clip > 0 or cfg.max_update_norm > 0:
        return ("dp-clip and max-update-norm bound one model's update, and a client with a "
                "twin sends two")
    return ""


def twin_reads_slice(cfg: RunConfig) -> bool:
    """Whether the twin keeps a guard slice of the share out of training and reports its
    reading on it: where the guard reads the clients; the coordinator's clean set is
    read on the server, and the twin then trains on every sample (docs/FEDEFC.md §3.8)."""
    return twin_mode(cfg) == "on" and not cfg.clean_validation_key


def twin_mode(cfg: RunConfig) -> str:
    """``on`` or ``off``; ``auto`` is ``on`` wherever a twin can be trained (every client
    in every round: the held-out signal), with observed or verified labels on the share
    (docs/FEDEFC.md §3.8)."""
    if cfg.twin_model != "auto":
        return cfg.twin_model
    return "off" if twin_obstacle(cfg) else "on"


def check_variant(cfg: RunConfig) -> None:
    """The combinations of FedEFC's options that cannot run (ValueError naming the key,
    the value and the fix): a gain, a guard or verified labels without the share they
    read; a clean set beside another way for the guard to read the clients; a fallback,
    a cross-fitted score, an estimation share or a guard slice without what they need; a
    twin asked for where none can be trained."""
    if cfg.prestopping_min_gain not in ("auto", 0.0) and \
            cfg.accuracy_signal_mode != "held-out":
        raise ValueError(
            f"prestopping-min-gain={cfg.prestopping_min_gain} with accuracy-signal="
            f"{cfg.accuracy_signal!r} (resolved {cfg.accuracy_signal_mode!r}): the gain is "
            "counted in standard errors of the accuracy on the validation shares, which "
            "only the held-out signal keeps; set accuracy-signal=\"held-out\" (or let "
            "\"auto\" choose it: every client in every round) or prestopping-min-gain=0")
    for setting, active, other_fix in (
            ('phase-2-guard="on"', cfg.phase_2_guard == "on",
             ' or phase-2-guard="auto" (docs/FEDEFC.md §3.4)'),
            ('validation-labels="verified"', cfg.validation_labels == "verified",
             ' (docs/FEDEFC.md §3.7)')):
        if active and cfg.accuracy_signal_mode != "held-out":
            raise ValueError(
                f"{setting} with accuracy-signal={cfg.accuracy_signal!r} (resolved "
                f"{cfg.accuracy_signal_mode!r}): it reads the global model's accuracy on "
                "the validation share, which only the held-out signal keeps; set "
                f"accuracy-signal=\"held-out\"{other_fix}")
    key = cfg.clean_validation_key
    for setting, active in (
            ('validation-labels="verified"', cfg.validation_labels == "verified"),
            ('guard-score="cross-fit"', cfg.guard_score == "cross-fit"),
            ('validation-phase-2="guard-slice"', cfg.validation_phase_2 == "guard-slice")):
        if key and active:
            raise ValueError(
                f"{key} with {setting}: the guard reads the coordinator's clean set, "
                f"and {setting} is a way for it to read the clients' shares instead "
                "(docs/FEDEFC.md §3.4, §3.6, §3.7); drop one of the two")
    if cfg.guard_fallback == "train" and not (cfg.guarded and cfg.guard_reads_clean):
        raise ValueError(
            "guard-fallback=\"train\" needs the phase-2 guard reading checked labels "
            "(validation-labels=\"verified\" or a clean-validation set, and the guard "
            "on): on observed labels "
            "the models cross-entropy trains on after the fallback fit the noise, and "
            "nothing the guard reads tells (docs/FEDEFC.md §3.7); set "
            "guard-fallback=\"end\"")
    if cfg.guard_score == "cross-fit" and not (cfg.guarded and
                                                 cfg.validation_labels == "observed"):
        raise ValueError(
            "guard-score=\"cross-fit\" needs the phase-2 guard reading observed labels "
            f"(the guard is {'on' if cfg.guarded else 'off'}, validation-labels="
            f"{cfg.validation_labels!r}): it is how the guard reads a model on observed "
            "labels (docs/FEDEFC.md §3.4); set guard-score=\"prior-q\", or turn the "
            "guard on (every client in every round, phase-2-guard=\"auto\")")
    if cfg.estimation_share and cfg.validation_labels != "verified":
        raise ValueError(
            f"estimation-share={cfg.estimation_share} with validation-labels="
            f"{cfg.validation_labels!r}: the estimation share is the observed-label "
            "part beside a share of verified labels; with observed labels Q is already "
            "counted on the validation share (validation-phase-2=\"estimate\"), so set "
            "estimation-share=0, or validation-labels=\"verified\" (docs/FEDEFC.md §3.7)")
    if cfg.validation_labels == "verified" and cfg.validation_phase_2 != "estimate":
        raise ValueError(
            "validation-labels=\"verified\" with validation-phase-2="
            f"{cfg.validation_phase_2!r}: the verified share must stay out of training, "
            "or the phase-2 guard would read a training accuracy; set "
            "validation-phase-2=\"estimate\" (docs/FEDEFC.md §3.7)")
    if cfg.validation_phase_2 == "guard-slice" and not cfg.guarded:
        raise ValueError(
            "validation-phase-2=\"guard-slice\" with the phase-2 guard off: the slice "
            "is kept out of training for the guard to read, and without it Q is better "
            "counted on the whole share; set validation-phase-2=\"estimate\" (or "
            "\"train\"), or turn the guard on (every client in every round, "
            "phase-2-guard=\"auto\"; docs/FEDEFC.md §3.6)")
    why = twin_obstacle(cfg)
    if cfg.twin_model == "on" and why:
        raise ValueError(f"twin-model=\"on\": {why}; set twin-model=\"auto\" or \"off\"")
