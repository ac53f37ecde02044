#!/usr/bin/env bash
# One GPU session, prepared to run as ONE command within BUDGET_S (docs/BENCHMARKS.md, "GPU").
# PLAN is the order of its steps, each run while time is left (default: issue 46's one
# call, `preset floor authors:mnist capture authors:cifar10`, the last ones skipped where
# the budget ends: docs/BENCHMARKS.md, "The next GPU call"):
#   cell:METHOD  a paper-scale MNIST cell, `fedefc run mnist` at (alpha-dir, p) = (10, 0.5),
#                (rho, zeta) = (0.2, 0.8), seed 0 (the preset's own settings otherwise);
#   silo:METHOD  the default run on the embedded data with num-clients=5, fraction=1.0
#                (every client in every round: the cross-silo run of docs/FEDEFC.md §3.1),
#                seed 0;
#   bench        the bench_gpu.py sweep (GPU share per client x precision) with BENCH_ARGS;
#   preset       the paper's MNIST preset start to summary, `fedefc run mnist` for its 100
#                rounds, seed 0; its seconds from the step's start to the summary into
#                cells.log, its summary.json and metrics.jsonl;
#   capture      bench_step_capture.py: one client's local update with its step replayed
#                from a CUDA graph against the eager loop (cnn9, resnet18, resnet34):
#                ms/step, speed-up, the weights' largest difference after one step (against
#                two eager runs' own) and after all steps (against a one-ulp start's);
#   overhead     bench_client_overhead.py on the device: a client's ms per training message
#                beyond its training steps, mnist-lite (LeNet-5, E = 5), 10 clients;
#   floor        bench_simulation.py: the paper's MNIST preset (FLOOR_ROUNDS rounds, default 3)
#                as a plain single-process loop on the device and through Flower, same data;
#   authors:P    bench_authors.py: the authors' code (a checkout in AUTHORS, default
#                .authors/FedEFC, carried uncommitted) on preset P (mnist, cifar10, cifar100),
#                AUTHORS_ROUNDS rounds (default 5), synthetic data of P's shape.
# Results go to $OUT, at most 8 files (the device tool's limit): bench.log (environment and
# sweep and the overhead table), bench-results.json, cells.log
# (exit codes and each cell log's tail), and each cell's summary.json and metrics.jsonl.
#
#   OUT=/abs/out MNIST_DIR=/abs/dir-with-MNIST/raw [MNIST_GZ=folder-of-the-4-.gz] \
#       [BUDGET_S=540] [PLAN="cell:fedefc bench cell:fedavg"] \
#       [BENCH_ARGS="--rounds 4 --settings 0.125:bf16"] [TINY=1] \
#       bash tests/benchmarks/gpu_session.sh
#
# TINY=1 is the CPU rehearsal: bench_gpu.py --tiny and a 3-round LeNet cell on CPU.
# Missing Python packages (flwr, ray, cleanlab, ...) travel as .whl/site.tar.xz, made by
# tests/benchmarks/gpu_pack.sh (or as wheels in .whl/): unpacked into /tmp/site first.
# MNIST_GZ: the four .gz files of MNIST, unpacked into MNIST_DIR/MNIST/raw first.
set -u
OUT=${OUT:?set OUT to the folder that receives the results}
MNIST_DIR=${MNIST_DIR:?set MNIST_DIR to an absolute folder holding MNIST/raw}
BUDGET_S=${BUDGET_S:-540}
PYTHON=${PYTHON:-python3}
start=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
export PYTHONPATH=$PWD
if [ -f .whl/site.tar.xz ]; then
  mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site || exit 1
elif compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
fi
if [ -d /tmp/site ]; then  # console scripts (flwr, flower-superlink, ...) for this Python
  py=$(command -v "$PYTHON")
  for f in /tmp/site/bin/*; do
    head -c2 "$f" | grep -q '#!' && sed -i "1s|.*|#!$py|" "$f"
  done
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
if [ -n "${MNIST_GZ:-}" ]; then
  mkdir -p "$MNIST_DIR/MNIST/raw"
  for f in "$MNIST_GZ"/*.gz; do gzip -dc "$f" > "$MNIST_DIR/MNIST/raw/$(basename "$f" .gz)"; done
fi
mkdir -p "$OUT"
"$PYTHON" -c "import torch, flwr; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'flwr', flwr.__version__)" \
    2>&1 | tee "$OUT/bench.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/bench.log"

if [ "${TINY:-0}" = 1 ]; then
  bench=(--tiny); cell=(--set model=lenet --set device=cpu --set rounds=3 --set start-round=1)
else
  read -r -a bench <<< "${BENCH_ARGS:---rounds 5}"; cell=()
fi

run_cell() {  # NAME ARGS...: one `fedefc run`, cut at the budget
  local name=$1 run=/tmp/cells/$1; shift
  rm -rf "$run"  # a warm machine keeps the last call's runs
  timeout $(( $(left) - 20 )) "$PYTHON" -m fedefc_cli run "$@" --set seed=0 "${cell[@]}" \
      --out-dir "$run" > "/tmp/cell-$name.log" 2>&1
  echo "== $name exit $? at $(( $(date +%s) - start )) s" | tee -a "$OUT/cells.log"
  tail -n 15 "/tmp/cell-$name.log" >> "$OUT/cells.log"
  for f in summary.json metrics.jsonl; do cp "$run/$f" "$OUT/$name-$f" 2>/dev/null; done
}

for step in ${PLAN:-preset floor authors:mnist capture authors:cifar10}; do
  [ "$(left)" -gt 90 ] || { echo "no time left for $step" | tee -a "$OUT/cells.log"; continue; }
  case $step in
    bench) rm -rf /tmp/bench-gpu  # a warm machine keeps the last call's runs
           timeout $(( $(left) - 30 )) "$PYTHON" tests/benchmarks/bench_gpu.py "${bench[@]}" \
               --out /tmp/bench-gpu 2>&1 | tee -a "$OUT/bench.log"
           cp /tmp/bench-gpu/results.json "$OUT/bench-results.json" 2>/dev/null ;;
    capture) if [ "${TINY:-0}" = 1 ]; then capture=(--tiny); else capture=(); fi
             timeout $(( $(left) - 30 )) "$PYTHON" tests/benchmarks/bench_step_capture.py \
                 "${capture[@]}" 2>&1 | tee -a "$OUT/bench.log" ;;
    overhead) device=cuda; [ "${TINY:-0}" = 1 ] && device=cpu
              timeout $(( $(left) - 30 )) "$PYTHON" tests/benchmarks/bench_client_overhead.py \
                  --data-dir "$MNIST_DIR" --device $device --repeats 2 2>&1 | tee -a "$OUT/bench.log" ;;
    floor) if [ "${TINY:-0}" = 1 ]; then floor=(--preset mnist-lite --rounds 4 --set device=\"cpu\")
           else floor=(--preset mnist --rounds "${FLOOR_ROUNDS:-3}" --set device=\"cuda\"); fi
           timeout $(( $(left) - 30 )) "$PYTHON" tests/benchmarks/bench_simulation.py \
               --data-dir "$MNIST_DIR" --repeats 1 --sides plain,flower "${floor[@]}" 2>&1 \
               | tee -a "$OUT/bench.log" ;;
    preset) began=$(date +%s)
            run_cell preset mnist --set data-dir="\"$MNIST_DIR\""
            echo "== preset: start to summary $(( $(date +%s) - began )) s" \
                | tee -a "$OUT/cells.log" "$OUT/bench.log" ;;
    authors:*) if [ "${TINY:-0}" = 1 ]; then authors=(--tiny --device cpu)
               else authors=(--rounds "${AUTHORS_ROUNDS:-5}" --device cuda); fi
               timeout $(( $(left) - 30 )) "$PYTHON" tests/benchmarks/bench_authors.py \
                   --authors "${AUTHORS:-$PWD/.authors/FedEFC}" --preset "${step#authors:}" \
                   "${authors[@]}" 2>&1 | tail -n 4 | tee -a "$OUT/bench.log" ;;
    cell:*) run_cell "cell-${step#cell:}" mnist --set data-dir="\"$MNIST_DIR\"" \
                --set method="${step#cell:}" --set alpha-dir=10.0 --set p=0.5 \
                --set rho=0.2 --set zeta=0.8 ;;
    silo:*) run_cell "silo-${step#silo:}" --set method="${step#silo:}" --set num-clients=5 \
                --set fraction=1.0 ;;
    *) echo "unknown step $step in PLAN" | tee -a "$OUT/cells.log" ;;
  esac
done
echo "done in $(( $(date +%s) - start )) s" | tee -a "$OUT/cells.log"
