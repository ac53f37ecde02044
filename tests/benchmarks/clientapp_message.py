"""One ClientApp message in this fresh process, as a SuperNode's app process handles it:
import the ClientApp module, then handle one training message (FedEFC: after the node
registry's query, its data from the disk cache). Prints the CPU seconds of each part as
JSON. Run by bench_flower_floor.py (``PYTHONPATH``: the app's folder, then this checkout).

    python tests/benchmarks/clientapp_message.py noop|fedefc CACHE_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time

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

from common.methods import load_run_config  # noqa: E402
from common.models import TaskShape, build_model  # noqa: E402
from common.params import get_weights  # noqa: E402
from fedefc_cli.run_configs import resolve_run_config  # noqa: E402
from tests.helpers import InProcessGrid  # noqa: E402


def fedefc_message() -> float:
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
    begin = time.process_time()
    proxy.get_properties(GetPropertiesIns({}), timeout=None, group_id="0")
    proxy.fit(FitIns(ndarrays_to_parameters(weights), {"round": 1, "seed": 5, "phase": 1}),
              timeout=None, group_id="1")
    return time.process_time() - begin


def noop_message() -> float:
    grid = InProcessGrid(client_app.app, {"marker-dir": ""}, 1)
    content = RecordDict({"arrays": ArrayRecord([np.zeros(44426, dtype=np.float32)])})
    begin = time.process_time()
    grid.send_and_receive([Message(RecordDict(), dst_node_id=1000, message_type="query")])
    grid.send_and_receive([Message(content, dst_node_id=1000, message_type="train")])
    return time.process_time() - begin


handled = fedefc_message() if kind == "fedefc" else noop_message()
print(json.dumps({"import_cpu_s": imported - start, "message_cpu_s": handled}))
