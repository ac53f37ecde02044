"""The app's methods and the run config that selects one (docs/ARCHITECTURE.md, "A new method").

Every method has a name here, a local update in ``fedefc_client/client.py: LOCAL_UPDATES``
and a strategy in ``fedefc_server/server_app.py: STRATEGIES``. A method with run-config
keys of its own names their settings model here; :func:`load_run_config` validates the
shared keys and every method's keys, so a bad ``fedcorr-beta`` fails whatever the method.
"""

from __future__ import annotations

from typing import Any

from .baselines.fedcorr import FedCorrSettings
from .baselines.fedditto import DittoSettings
from .baselines.fednoro import FedNoRoSettings
from .baselines.fedprox import FedProxSettings
from .baselines.forward_correction import ForwardCorrectionSettings
from .baselines.rofl import RoFLSettings
from .config import (
    MethodSettings,
    RunConfig,
    config_differences,
    effective_accuracy_signal,
    parse_run_config,
)

# method -> the model of its own run-config keys (None: it has none)
SETTINGS: dict[str, type[MethodSettings] | None] = {
    "fedefc": None,
    "fedavg": None,
    "fedprox": FedProxSettings,
    "fedditto": DittoSettings,
    "forward-correction": ForwardCorrectionSettings,
    "confident-learning": None,
    "fedcorr": FedCorrSettings,
    "fednoro": FedNoRoSettings,
    "rofl": RoFLSettings,
}

# Methods whose reply counts only the samples it trained on, at most the client's size
# (confident learning's kept count); every other reply counts exactly the client's size.
SUBSET_COUNTS = frozenset({"confident-learning"})


# methods that need the model's penultimate features (common/models.py: provides_features)
NEEDS_FEATURES = frozenset({"rofl"})


def load_run_config(flat: dict[str, Any]) -> RunConfig:
    """Validate Flower's flat run config; raise ConfigError naming each bad key."""
    return parse_run_config(flat, SETTINGS)


def default_config() -> dict[str, Any]:
    """Every run-config key with its default, flat."""
    return load_run_config({}).to_flat()


def changed_keys(stored: dict[str, Any], wanted: dict[str, Any],
                 ignore: frozenset[str] = frozenset()) -> dict[str, tuple[Any, Any]]:
    """{key: (stored, wanted)} where a stored resolved config differs from a wanted one;
    a key the stored config lacks counts as its default (:func:`config_differences`).
    ``accuracy-signal`` compares as resolved: a run stored with ``global`` is the run
    that ``auto`` asks for where ``auto`` resolves to ``global`` (docs/FEDEFC.md §3.1)."""
    stored = {**stored, "accuracy-signal": effective_accuracy_signal(stored)}
    if "accuracy-signal" in wanted:
        wanted = {**wanted, "accuracy-signal": effective_accuracy_signal(wanted)}
    return config_differences(stored, wanted, default_config(), ignore)
