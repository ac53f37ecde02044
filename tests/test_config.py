"""Run-config validation: every bad key or value is an error naming it."""

import tomllib
from pathlib import Path

import pytest

from common.baselines.fedcorr import FedCorrSettings
from common.config import ConfigError, RunConfig
from common.methods import METHODS, default_config, load_object, load_run_config
from fedefc_cli.keys_doc import PYPROJECT, KeysDocError, keys_doc, read_tiers, render
from fedefc_cli.main import main
from fedefc_cli.run_configs import parse_overrides, read_preset, resolve_run_config
from fedefc_server.method_server import MethodServer

SETTINGS = {m.name: m.settings for m in METHODS.values()}

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_declares_every_key_with_the_model_defaults():
    with open(ROOT / "pyproject.toml", "rb") as fh:
        declared = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    assert declared == default_config()


def test_every_methods_entry_names_a_server_in_the_server_app_and_an_update_in_the_client():
    """Each app resolves its half of every registry entry, and only its own package."""
    for method in METHODS.values():
        assert method.server.startswith("fedefc_server.")
        assert issubclass(load_object(method.server), MethodServer)
        assert method.local_update.startswith("fedefc_client.")
        assert callable(load_object(method.local_update))


def test_the_docs_method_table_says_what_the_registry_says():
    rows = {}
    for line in (ROOT / "docs" / "BASELINE-METHODS.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            rows[cells[0]] = (cells[1], cells[2])
    assert rows == {m.name: (m.server, m.local_update) for m in METHODS.values()}


def test_a_methods_keys_are_validated_by_its_own_model_not_by_the_shared_config():
    """The shared RunConfig knows no baseline key; each method's model owns its keys,
    and a bad value fails whatever the run's method."""
    shared = set(RunConfig.model_fields)
    for model in filter(None, SETTINGS.values()):
        assert not shared & set(model.model_fields), model
    cfg = load_run_config({"method": "fedcorr", "fedcorr-beta": 2.5})
    assert cfg.settings(FedCorrSettings).fedcorr_beta == 2.5
    assert cfg.to_flat()["fedcorr-beta"] == 2.5 and not hasattr(cfg, "fedcorr_beta")
    with pytest.raises(ConfigError, match="'fedcorr-beta' = -1"):
        load_run_config({"method": "fedavg", "fedcorr-beta": -1})


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "configs").glob("*.toml")))
def test_presets_validate(preset):
    flat = {**default_config(), **read_preset(preset), "data-dir": "/data"}
    assert load_run_config(flat).dataset == flat["dataset"]


def test_paper_presets_follow_the_papers_settings():
    paper = {"mnist": ("cnn9", 100, 64, 10, 3, 0.03), "mnist-lite": ("lenet", 100, 64, 10, 3, 0.03),
            "cifar10": ("resnet18", 200, 10, 40, 6, 0.03),
            "cifar100": ("resnet34", 300, 10, 40, 6, 0.01)}
    for name, (model, rounds, batch, start, gamma, lr) in paper.items():
        p = read_preset(name)
        assert (p["model"], p["rounds"], p["batch-size"], p["start-round"], p["gamma-thr"],
                p["lr"]) == (model, rounds, batch, start, gamma, lr)
        assert (p["num-clients"], p["fraction"], p["local-epochs"], p["momentum"]) == \
            (100, 0.1, 5, 0.5)


@pytest.mark.parametrize("flat,key", [
    ({"rho": "high"}, "rho"),
    ({"rho": 1.5}, "rho"),
    ({"zeta": -0.1}, "zeta"),
    ({"rho": 0.3, "zeta": 1.0}, "zeta=1"),
    ({"dataset": "svhn"}, "dataset"),
    ({"num-clients": 0}, "num-clients"),
    ({"fraction": 0.0}, "fraction"),
    ({"fraction": 0.01, "num-clients": 10}, "fraction=0.01"),
    ({"batch-size": 2.5}, "batch-size"),
    ({"count-rule": "median"}, "count-rule"),
    ({"weighting": "prior"}, "weighting"),
    ({"accuracy-signal": "test"}, "accuracy-signal"),
    ({"start-round": 50, "rounds": 10}, "start-round=50"),
    ({"dataset": "mnist", "data-dir": "data"}, "data-dir='data'"),
    ({"out-dir": "runs/x"}, "out-dir='runs/x'"),
    ({"noise-groups": "0.2-0.4"}, "noise-groups"),
    ({"learning-rate": 0.1}, "learning-rate"),
    ({"device": "tpu"}, "device"),
    ({"gamma-thr": 0}, "gamma-thr"),
])
def test_bad_values_name_the_key(flat, key):
    with pytest.raises(ConfigError) as err:
        load_run_config(flat)
    assert key in str(err.value)


def test_noise_groups_parse():
    cfg = load_run_config({"noise-groups": "0.2:0.4;0.4:0.8"})
    assert [(g.rho, g.zeta) for g in cfg.noise_group_list()] == [(0.2, 0.4), (0.4, 0.8)]


def test_overrides_parse_toml_scalars():
    assert parse_overrides(["rho=0.4", "iid=true", "rounds=5", "count-rule=masked",
                            'out-dir="/tmp/x"']) == {
        "rho": 0.4, "iid": True, "rounds": 5, "count-rule": "masked", "out-dir": "/tmp/x"}


def test_resolve_refuses_a_used_output_folder(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds results"):
        resolve_run_config(None, [], str(tmp_path))


def test_cli_bad_flag_exits_nonzero_and_creates_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", "--set", "rho=2", "--out-dir", str(out)]) == 2
    assert "rho" in capsys.readouterr().err
    assert not out.exists()
    assert main(["run", "no-such-preset", "--out-dir", str(out)]) == 2
    assert "no-such-preset" in capsys.readouterr().err


def test_the_run_config_is_validated_once_and_a_changed_dict_is_validated_again():
    """load_run_config caches by content: the ClientApp's mods share one validation, and
    a dict changed in place (as the launcher fills in out-dir) is not served stale."""
    flat = {"rounds": 7}
    first = load_run_config(flat)
    assert load_run_config(dict(flat)) is first and load_run_config(flat) is first
    flat["rounds"] = 8
    assert load_run_config(flat).rounds == 8 and load_run_config({"rounds": 7}) is first


def test_a_retired_key_is_read_from_a_stored_run_and_refused_when_it_asks_for_more():
    """``stacked-clients`` is gone (docs/BENCHMARKS.md): the config.json of a run made
    while it existed holds 0, which is dropped, so the run is still read and resumed; a
    group size asked for the removed path and is refused, naming what happened and the fix."""
    stored = {**default_config(), "stacked-clients": 0}
    flat = load_run_config(stored).to_flat()
    assert "stacked-clients" not in flat and flat == default_config()
    with pytest.raises(ConfigError, match=r"'stacked-clients' = 5: removed: .*delete the key"):
        load_run_config({"stacked-clients": 5})


def test_the_key_reference_is_pyprojects_declaration_as_tables(tmp_path):
    """docs/RUN-CONFIG.md is written from pyproject.toml by ``fedefc keys --write``: it
    matches, every declared key is in it once, tier 1 stays the dozen a user sets, and
    a changed comment makes the doc stale."""
    _, stale = keys_doc()
    assert not stale, "docs/RUN-CONFIG.md is stale: run `fedefc keys --write`"
    tiers = read_tiers(PYPROJECT.read_text())
    assert [len([k for g in t.groups for r in g.rows for k in r.keys]) for t in tiers][0] <= 12
    changed = tmp_path / "pyproject.toml"
    changed.write_text(PYPROJECT.read_text().replace("# training rounds", "# rounds"))
    assert keys_doc(pyproject=changed)[1]
    assert main(["keys", "--check"]) == 0  # `fedefc keys --check` agrees, writes nothing
    assert main(["keys", "--check", "--write"]) == 2


@pytest.mark.parametrize(("body", "names"), [
    ("## t\nrounds = 40\n", "'rounds' says nothing"),
    ("## t\n# above\nrounds = 40  # beside\n", "'rounds' has a comment above it and one"),
    ("rounds = 40  # training rounds\n", "before the first '## ' tier"),
    ("## t\nrounds 40\n", "not 'key = value"),
    ("## t\nrounds = 40  # training rounds\n\nseed = 0\n", r"missing from the tables \['seed'\]"),
])
def test_a_key_the_reference_cannot_tell_is_refused_naming_it(body, names):
    with pytest.raises(KeysDocError, match=names):
        render(f"[tool.flwr.app.config]\n{body}")
