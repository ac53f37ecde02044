"""Run configs as users write them: the app's defaults, presets, ``--set`` overrides.

A run's config is pyproject.toml's ``[tool.flwr.app.config]`` < a preset
(``configs/<name>.toml`` or a path) < ``--set KEY=VALUE`` overrides, validated with
:func:`common.methods.load_run_config` before anything starts, and written as the TOML
file ``flwr run --run-config`` takes.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.results import check_output_dir, run_folder

APP_DIR = Path(__file__).resolve().parents[1]
CONFIGS_DIR = APP_DIR / "configs"


def read_app_defaults(app_dir: Path = APP_DIR) -> dict[str, Any]:
    """The run-config keys and defaults declared in the app's pyproject.toml."""
    with open(app_dir / "pyproject.toml", "rb") as fh:
        return dict(tomllib.load(fh)["tool"]["flwr"]["app"]["config"])


def preset_names() -> list[str]:
    """The presets in ``configs/``."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))


def read_preset(preset: str | None) -> dict[str, Any]:
    """A preset by name (``configs/<name>.toml``) or by path; {} for none."""
    if not preset:
        return {}
    path = Path(preset)
    if not path.suffix:
        path = CONFIGS_DIR / f"{preset}.toml"
    if not path.is_file():
        raise ConfigError(f"preset {preset!r} not found (looked for {path}); known: "
                          f"{', '.join(preset_names())}")
    try:
        with open(path, "rb") as fh:
            return dict(tomllib.load(fh))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"preset {path} is not valid TOML: {err}") from None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs, values parsed as TOML scalars (strings may be bare)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} is not key=value; write e.g. --set rounds=50")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        out[key.strip()] = value
    return out


def merged_config(preset: str | None, overrides: list[str]) -> dict[str, Any]:
    """Defaults < preset < overrides, not yet validated."""
    return {**read_app_defaults(), **read_preset(preset), **parse_overrides(overrides)}


def resolve_run_config(preset: str | None, overrides: list[str],
                       out_dir: str | None) -> dict[str, Any]:
    """Defaults < preset < overrides, validated; ``out-dir`` made absolute and checked
    (default: :func:`common.results.run_folder`, the ServerApp's own rule)."""
    from common.methods import load_run_config  # lazy: torch, 1.9 s of CPU
    merged = merged_config(preset, overrides)
    if out_dir:
        merged["out-dir"] = str(Path(out_dir).expanduser().resolve())
    cfg = load_run_config(merged)
    merged["out-dir"] = run_folder(cfg.out_dir, cfg.resume_from, cfg.method, cfg.dataset,
                                   cfg.seed)
    cfg = load_run_config(merged)
    if not cfg.resume_from:
        check_output_dir(cfg.out_dir)
    return cfg.to_flat()


def resume_config(folder: str, overrides: list[str]) -> dict[str, Any]:
    """The config of the run in ``folder`` (its config.json), set to resume it there."""
    from common.methods import as_recorded, load_run_config  # lazy: torch, 1.9 s of CPU
    path = Path(folder).expanduser().resolve()
    try:
        stored = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot resume {str(path)!r}: its config.json is unreadable ({err}); "
                          "give the out-dir of an earlier run") from None
    merged = {**as_recorded(stored), **parse_overrides(overrides), "resume-from": str(path),
              "out-dir": str(path)}
    return load_run_config(merged).to_flat()


def inexact_resume_note(run_config: dict[str, Any]) -> str | None:
    """What an operator resuming this run must know when it cannot end exactly as the
    uninterrupted run would (:func:`resumes_exactly`; docs/RELIABILITY.md), else None."""
    from common.methods import (  # lazy: torch, 1.9 s of CPU
        counts_pooling,
        load_run_config,
        resumes_exactly,
    )
    cfg = load_run_config(run_config)
    if resumes_exactly(cfg):
        return None
    kept = ("its clients' pooled phase-2 counts (q-pooling)"
            if counts_pooling(cfg) != "none"
            else f"what {cfg.method}'s clients keep across rounds")
    return (f"note: {kept} live in the nodes' state, which a resumed run starts empty: it "
            "continues correctly but will not end bit for bit as the uninterrupted run "
            "(docs/RELIABILITY.md)")


def toml_value(value: Any) -> str:
    """A scalar as a TOML value (strings quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def write_run_config(path: Path, run_config: dict[str, Any]) -> Path:
    """``run_config`` as a TOML file for ``flwr run --run-config``."""
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()))
    return path
