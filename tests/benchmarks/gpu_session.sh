#!/usr/bin/env bash
# One GPU session, prepared to run as ONE command within 9 minutes (docs/BENCHMARKS.md, "GPU"):
#   1. the bench_gpu.py sweep (GPU share per client x precision, every paper preset);
#   2. then, while time is left, paper-scale MNIST cells: `fedefc run mnist` at
#      (alpha-dir, p) = (10, 0.5), (rho, zeta) = (0.2, 0.8), seed 0, FedEFC first, then FedAvg.
# Results (results.json, the bench log, each cell's summary.json and metrics.jsonl) go to $OUT.
#
#   OUT=/abs/out MNIST_DIR=/abs/dir-with-MNIST/raw [BUDGET_S=540] [TINY=1] \
#       bash tests/benchmarks/gpu_session.sh
#
# TINY=1 is the CPU rehearsal: bench_gpu.py --tiny and a 3-round LeNet cell on CPU.
# Missing Python packages (flwr, ray, cleanlab, ...) can be carried as wheels in .whl/:
# they are installed into /tmp/site first.
set -u
OUT=${OUT:?set OUT to the folder that receives the results}
MNIST_DIR=${MNIST_DIR:?set MNIST_DIR to an absolute folder holding MNIST/raw}
BUDGET_S=${BUDGET_S:-540}
PYTHON=${PYTHON:-python3}
start=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
mkdir -p "$OUT"
"$PYTHON" -c "import torch, flwr; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'flwr', flwr.__version__)" \
    2>&1 | tee "$OUT/env.txt"

if [ "${TINY:-0}" = 1 ]; then
  bench=(--tiny); cell=(--set model=lenet --set device=cpu --set rounds=3 --set start-round=1)
else
  bench=(--rounds 5); cell=()
fi
timeout $(( $(left) - 60 )) "$PYTHON" tests/benchmarks/bench_gpu.py "${bench[@]}" \
    --out /tmp/bench-gpu 2>&1 | tee "$OUT/bench.log"
cp /tmp/bench-gpu/results.json "$OUT/bench-results.json" 2>/dev/null

for method in fedefc fedavg; do
  [ "$(left)" -gt 90 ] || { echo "no time left for $method" | tee -a "$OUT/cells.log"; break; }
  run=/tmp/cells/$method
  timeout $(( $(left) - 20 )) "$PYTHON" -m fedefc_cli run mnist --set data-dir="\"$MNIST_DIR\"" \
      --set method=$method --set alpha-dir=10.0 --set p=0.5 --set rho=0.2 --set zeta=0.8 \
      --set seed=0 "${cell[@]}" --out-dir "$run" > "$OUT/cell-$method.log" 2>&1
  echo "$method exit $?" | tee -a "$OUT/cells.log"
  for f in summary.json metrics.jsonl; do cp "$run/$f" "$OUT/cell-$method-$f" 2>/dev/null; done
done
echo "done in $(( $(date +%s) - start )) s" | tee -a "$OUT/cells.log"
