"""Every site's class map is the federation's (issue 60; docs/OWN-DATA.md, "Preparing a
folder of images"): a node whose ``data.npz`` names its classes declares the map's
fingerprint, never the names, and the server refuses a node whose map differs from the
first one declared, naming both maps, the partitions and the fix."""

import json

import numpy as np
import torch

from common.data_files import class_map_fingerprint, read_samples
from common.methods import load_run_config
from common.messages import Declaration
from fedefc_client.client import MethodClient
from fedefc_client.local_data import node_data
from fedefc_server.declarations import SizeRule
from fedefc_server.registry import PartitionRegistry

CPU = torch.device("cpu")
DIGITS = [str(d) for d in range(10)]
SHIFTED = [d for d in DIGITS if d != "6"]  # a site lacking 6 that made its own map


def site_file(tmp_path, name: str, names: list[str] | None, k: int = 10) -> str:
    """A node's own features file of 30 samples over ``k`` labels, naming ``names``."""
    rng = np.random.default_rng(len(name))
    arrays = {"features": rng.normal(size=(30, 4)), "labels": np.arange(30) % k}
    if names is not None:
        arrays["class_names"] = np.array(names)
    path = tmp_path / f"{name}.npz"
    np.savez(path, **arrays)
    return str(path)


def declaration(tmp_path, name: str, pid: int, names: list[str] | None) -> dict:
    """What the node holding ``names`` declares (its data read as a SuperNode reads it)."""
    cfg = load_run_config({"dataset": "npz", "num-classes": 10, "input-shape": "4",
                           "num-clients": 3, "evaluation": "federated"})
    path = site_file(tmp_path, name, names, k=len(names or DIGITS))
    node = f"node {name} (partition-id {pid})"
    client = MethodClient(cfg, pid, lambda: node_data(cfg, pid, {"data-path": path}, node, CPU),
                          private_data=True)
    return client.get_properties({})


def test_the_fingerprint_tells_maps_apart_by_names_and_order_but_not_the_names():
    assert class_map_fingerprint(DIGITS) == class_map_fingerprint(list(DIGITS))
    assert class_map_fingerprint(DIGITS) != class_map_fingerprint([*DIGITS[1:], "0"])
    assert class_map_fingerprint(DIGITS).startswith("10:")
    assert class_map_fingerprint(SHIFTED).startswith("9:")
    assert "benign" not in class_map_fingerprint(["benign", "malignant"])


def test_a_file_s_class_names_are_read_in_index_order(tmp_path):
    path = site_file(tmp_path, "a", ["cat", "ant", "bee"], k=3)
    assert read_samples(path, "t").class_names == ("cat", "ant", "bee")
    assert read_samples(site_file(tmp_path, "b", None), "t").class_names is None


def test_a_node_with_another_class_map_is_refused_naming_both_maps_and_the_fix(tmp_path):
    """Sites 0 and 2 prepared their data with the shared ten-class map; site 1 lacked
    class 6 and wrote its own nine-class map, so its label 6 is the others' 7."""
    first = declaration(tmp_path, "a", 0, DIGITS)
    shifted = declaration(tmp_path, "b", 1, SHIFTED)
    same = declaration(tmp_path, "c", 2, DIGITS)
    assert first[Declaration.CLASS_MAP] == class_map_fingerprint(DIGITS)
    assert set(first) == {Declaration.PARTITION_ID, Declaration.NUM_EXAMPLES,
                          Declaration.HELD_OUT, Declaration.DATA, Declaration.CLASS_MAP}
    registry = PartitionRegistry(SizeRule(3, None, 10**8))
    assert registry.admit("a", first) is None
    reason = registry.admit("b", shifted)
    ten, nine = (class_map_fingerprint(n).split(":")[1] for n in (DIGITS, SHIFTED))
    assert reason.startswith(f"partition 1's data has class map 9 classes #{nine}, but the "
                             f"federation's is 10 classes #{ten} (declared by partition 0)")
    assert "fedefc data SOURCE OUT --class-map <the shared classes.json>" in reason
    assert registry.partition_of("b") is None and registry.partition_of("a") == 0
    assert registry.admit("c", same) is None


def test_a_node_without_class_names_is_not_compared_and_the_map_survives_a_checkpoint(
        tmp_path):
    registry = PartitionRegistry(SizeRule(3, None, 10**8))
    plain = declaration(tmp_path, "p", 0, None)
    assert Declaration.CLASS_MAP not in plain
    assert registry.admit("p", plain) is None and registry.class_map is None
    assert registry.admit("b", declaration(tmp_path, "b", 1, SHIFTED)) is None
    resumed = PartitionRegistry(SizeRule(3, None, 10**8))
    resumed.load_state(json.loads(json.dumps(registry.state())))
    assert "but the federation's is 9 classes" in resumed.admit(
        "a", declaration(tmp_path, "a", 2, DIGITS))


def test_a_class_map_that_is_not_text_is_a_malformed_declaration():
    registry = PartitionRegistry(SizeRule(3, None, 10**8))
    props = {"partition-id": 0, "num-examples": 5, "data": "private", "class-map": 7}
    assert registry.admit("x", props) == "malformed declaration: class-map is not text (7)"
