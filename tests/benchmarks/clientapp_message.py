"""One ClientApp message in this fresh process, as a SuperNode's app process handles it:
import the ClientApp module, then handle one training message (FedEFC: after the node
registry's query, its data from the disk cache). Prints the CPU seconds of each part as
JSON. FedEFC's handling counts from the end of the import: with the harness's imports
(torch and the model, which a FedEFC ClientApp imports on its first message; the test
grid); the no-op's counts the message alone (the no-op app never imports torch). Run by bench_flower_floor.py (``PYTHONPATH``: the app's folder, then this checkout).
With ``--forked``, what the zygote imported (fedefc_cli/app_zygote.py: PRELOAD) is
imported before the clock starts, as in an app process forked from it.

    python tests/benchmarks/clientapp_message.py noop|fedefc CACHE_DIR OUT_DIR [--forked]
"""

from __future__ import annotations

import importlib
import json
import sys
import time

if "--forked" in sys.argv:
    from fedefc_cli.app_zygote import PRELOAD
    for name in PRELOAD:
        importlib.import_module(name)
start = time.process_time()
kind, cache_dir, out_dir = sys.argv[1:4]
if kind == "fedefc":
    import fedefc_client.client_app as client_app
else:
    import noop_app.client_app as client_app
imported = time.process_time()

# the harness, after the timed import
import numpy as np  # noqa: E402
from flwr.app import ArrayRecord, Message, RecordDict  # noqa: E402
from flwr.common import FitIns, GetPropertiesIns, ndarrays_to_parameters  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from common.methods import load_run_config  # noqa: E402
from common.models import TaskShape, build_model  # noqa: E402
from common.params import get_weights  # noqa: E402
from fedefc_cli.run_configs import resolve_run_config  # noqa: E402
from tests.helpers import InProcessGrid  # noqa: E402


def fedefc_message() -> None:
    overrides = [f"{k}={v}" for k, v in {
        "dataset": '"mnist-embedded"', "model": '"lenet"', "num-clients": 3, "fraction": 1.0,
        "rounds": 5, "local-epochs": 1, "batch-size": 32, "start-round": 2, "gamma-thr": 2,
        "rho": 0.4, "zeta": 0.4, "client-threads": 1, "accuracy-signal": '"global"'}.items()]
    run_config = resolve_run_config(None, overrides, out_dir)
    cfg = load_run_config(run_config)
    weights = get_weights(build_model("lenet", TaskShape((1, 28, 28), 10), cfg.seed))
    grid = InProcessGrid(client_app.app, run_config, 3)
    grid.contexts[1000].node_config["cache-dir"] = cache_dir
    proxy = grid.manager().all()["1000"]
    proxy.get_properties(GetPropertiesIns({}), timeout=None, group_id="0")
    proxy.fit(FitIns(ndarrays_to_parameters(weights), {"round": 1, "seed": 5, "phase": 1}),
              timeout=None, group_id="1")


def noop_message() -> float:
    grid = InProcessGrid(client_app.app, {"marker-dir": ""}, 1)
    content = RecordDict({"arrays": ArrayRecord([np.zeros(44426, dtype=np.float32)])})
    begin = time.process_time()
    grid.send_and_receive([Message(RecordDict(), dst_node_id=1000, message_type="query")])
    grid.send_and_receive([Message(content, dst_node_id=1000, message_type="train")])
    return time.process_time() - begin


TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as Flower's
if kind == "fedefc":
    fedefc_message()
    handled = time.process_time() - imported
else:
    handled = noop_message()
print(json.dumps({"import_cpu_s": imported - start, "message_cpu_s": handled}))
