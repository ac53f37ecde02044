#!/usr/bin/env bash
# The Docker Compose demo end to end (docs/DEPLOYMENT.md, "Docker Compose demo"): build the
# images, bring up the TLS federation of deploy/compose.yml + compose.tls.yml (a SuperLink
# with its SuperExec, three SuperNodes with their own data, node authentication,
# SuperExec secrets, a Fleet-only front between the SuperNodes and the SuperLink), submit
# a short FedEFC run, check that it completed with every node's results and that a
# SuperNode reaches the Fleet API only (no route to the SuperLink; the Control API
# through the front answered 403), print the figures (build, bring-up and run times,
# image sizes) and tear everything down (containers, networks, volumes, the demo's
# files), whatever happens.
# Needs a Docker daemon and the Compose CLI (`docker compose`, or `docker-compose` v1),
# openssl, and this project installed on the host (the fedefc and flwr CLIs: Install).
# Not part of the test suite (it needs Docker); run it by hand.
#
# usage: deploy/compose-demo.sh [--base-image IMAGE] [--torch-index URL] [--port PORT]
#                               [--rounds N] [--project NAME] [--keep]
#   --base-image IMAGE  build stand-ins of Flower's images (local/flwr-superlink:1.42.0,
#                       ...-supernode, ...-superexec; deploy/flwr-standins.Dockerfile) on
#                       IMAGE, a Python >= 3.11 image (deploy/make-base-image.sh builds one
#                       from Debian's mirror), and use them, and build the Fleet-only
#                       front (nginx) on IMAGE too, which must then be Debian bookworm:
#                       for a host that reaches no container registry. Default: Flower's
#                       own images and debian:bookworm-slim (pulled).
#   --torch-index URL   where the SuperExec image takes torch (default: PyTorch's CPU
#                       index; https://pypi.org/simple where that is unreachable)
#   --port PORT         the host port (127.0.0.1) of the SuperLink (default: a free one)
#   --rounds N          rounds of the demo run (default 3; deploy/demo-run-config.toml,
#                       with start-round=1 gamma-thr=1)
#   --project NAME      the Compose project name (default fedefc-demo)
#   --keep              leave the federation running and its files in place (the script
#                       prints how to stop it) instead of tearing it down
# Env: DEMO_WAIT_S (default 900): how long to wait for the SuperLink and the SuperNodes
# to come up before giving up. Exit 0 only when the run completed with every node's
# results in every round.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
py="$(fedefc_python)"
bindir="$(dirname "$py")"

say() { printf '[compose-demo %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { say "FAILED: $*" >&2; exit 1; }
usage() { sed -n '15,34p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

base_image="" torch_index="" port="" rounds=3 project=fedefc-demo keep=0
while [ "$#" -gt 0 ]; do
    case "$1" in
        --base-image) base_image="${2:?--base-image needs an image name}"; shift 2 ;;
        --torch-index) torch_index="${2:?--torch-index needs a URL}"; shift 2 ;;
        --port) port="${2:?--port needs a number}"; shift 2 ;;
        --rounds) rounds="${2:?--rounds needs a number}"; shift 2 ;;
        --project) project="${2:?--project needs a name}"; shift 2 ;;
        --keep) keep=1; shift ;;
        -h|--help) usage ;;
        *) echo "$0: unknown argument '$1'" >&2; usage ;;
    esac
done
[[ "$rounds" =~ ^([2-9]|[1-9][0-9]+)$ ]] \
    || die "--rounds '$rounds' is not a whole number >= 2 (prestopping starts after round 1); e.g. --rounds 3"
wait_s="${DEMO_WAIT_S:-900}"
[[ "$wait_s" =~ ^[1-9][0-9]*$ ]] || die "DEMO_WAIT_S='$wait_s' is not a number of seconds; e.g. DEMO_WAIT_S=900"

command -v docker >/dev/null || die "docker not found: install Docker (docs/DEPLOYMENT.md, Docker Compose demo)"
docker info >/dev/null 2>&1 || die "no Docker daemon answers (docker info failed): start it (e.g. systemctl start docker, or dockerd &)"
command -v openssl >/dev/null || die "openssl not found: install it (the demo's certificates)"
if docker compose version >/dev/null 2>&1; then
    compose_cli=(docker compose)
elif command -v docker-compose >/dev/null; then
    compose_cli=(docker-compose)
else
    die "neither 'docker compose' nor 'docker-compose' found: install the Compose CLI"
fi

if [ -z "$port" ]; then
    port="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
elif ! "$py" -c 'import socket, sys; socket.socket().bind(("127.0.0.1", int(sys.argv[1])))' "$port" 2>/dev/null; then
    die "--port $port: 127.0.0.1:$port is in use or not a port; choose a free one (or leave --port out)"
fi

demo="$(mktemp -d "${TMPDIR:-/tmp}/fedefc-compose-demo.XXXXXX")"
export FEDEFC_DEMO_DIR="$demo" FEDEFC_DEMO_PORT="$port" FLWR_HOME="$demo/flwr-home"
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
compose=("${compose_cli[@]}" -p "$project" -f "$deploy_dir/compose.yml" -f "$deploy_dir/compose.tls.yml")
connection=fedefc-demo-tls
fedefc() { "$py" -m fedefc_cli "$@"; }

teardown() {
    local code=$?
    if [ "$keep" = 1 ]; then
        say "kept running (--keep). Stop it with: FEDEFC_DEMO_DIR=$demo FEDEFC_DEMO_PORT=$port ${compose[*]} down -v; rm -rf $demo"
        return
    fi
    say "tearing down: ${compose[*]} down -v"
    "${compose[@]}" down -v --remove-orphans >"$demo/down.log" 2>&1 \
        || { say "compose down failed:"; cat "$demo/down.log" >&2; code=1; }
    rm -rf "$demo"
    exit "$code"
}
trap teardown EXIT
trap 'exit 130' INT TERM

elapsed() { echo $(( $(date +%s) - $1 )); }

# -- images ------------------------------------------------------------------------------
t0=$(date +%s)
if [ -n "$base_image" ]; then
    docker image inspect "$base_image" >/dev/null 2>&1 \
        || die "--base-image $base_image: no such image here; build one with deploy/make-base-image.sh (TAG=$base_image)"
    for t in superlink supernode superexec; do
        say "building the stand-in local/flwr-$t:1.42.0 on $base_image"
        DOCKER_BUILDKIT=0 docker build -q --target "$t" --build-arg "BASE_IMAGE=$base_image" \
            -t "local/flwr-$t:1.42.0" -f "$deploy_dir/flwr-standins.Dockerfile" "$deploy_dir" >/dev/null
    done
    export FLWR_SUPERLINK_IMAGE=local/flwr-superlink:1.42.0
    export FLWR_SUPERNODE_IMAGE=local/flwr-supernode:1.42.0
    export FLWR_SUPEREXEC_IMAGE=local/flwr-superexec:1.42.0
    export FLEET_FRONT_BASE_IMAGE="$base_image"
fi
standins_s=$(elapsed "$t0")
[ -n "$torch_index" ] && export TORCH_INDEX_URL="$torch_index"
say "building the SuperExec image fedefc-superexec:1.42.0 (on ${FLWR_SUPEREXEC_IMAGE:-flwr/superexec:1.42.0}) and the Fleet-only front"
t1=$(date +%s)
DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0 "${compose[@]}" build superexec-serverapp fleet-front \
    >"$demo/build.log" 2>&1 || { tail -30 "$demo/build.log" >&2; die "building the images (log above)"; }
build_s=$(elapsed "$t1")
say "images built: stand-ins ${standins_s} s, SuperExec image ${build_s} s"

# -- the nodes' data, certificates, keys, secrets ------------------------------------------
say "writing the nodes' data, certificates, node keys and SuperExec secrets under $demo"
fedefc deploy export "$demo/data" "$deploy_dir/demo-run-config.toml" >"$demo/export.log" 2>&1 \
    || { cat "$demo/export.log" >&2; die "fedefc deploy export"; }
"$deploy_dir/gen-certs.sh" "$demo/certs" superlink fleet-front >/dev/null
"$deploy_dir/gen-node-keys.sh" "$demo/keys" node-0 node-1 node-2 >/dev/null
"$deploy_dir/gen-secret.sh" "$demo/secrets/superexec-link" \
    "$demo"/secrets/superexec-node-{0,1,2} >/dev/null
# the private files the containers (uid 49999) read, given to that uid alone: chown in a
# container (as root there), so the host user needs no sudo
private=(certs/server.key keys/node-0 keys/node-1 keys/node-2 secrets/superexec-link
         secrets/superexec-node-0 secrets/superexec-node-1 secrets/superexec-node-2)
docker run --rm --user 0 --entrypoint chown -v "$demo:/demo" \
    "${FLWR_SUPERLINK_IMAGE:-flwr/superlink:1.42.0}" 49999:49999 "${private[@]/#//demo/}"

# -- bring-up ------------------------------------------------------------------------------
say "starting the SuperLink on 127.0.0.1:$port (TLS, node authentication)"
t2=$(date +%s)
"${compose[@]}" up -d superlink >"$demo/up.log" 2>&1 || { cat "$demo/up.log" >&2; die "compose up superlink"; }
fedefc deploy connection "$connection" "127.0.0.1:$port" --ca-cert "$demo/certs/ca.crt" >/dev/null
PATH="$bindir:$PATH" timeout "$wait_s" "$deploy_dir/register-nodes.sh" "$connection" \
    "$demo"/keys/node-{0,1,2}.pub || die "registering the node keys (SuperLink log: ${compose[*]} logs superlink)"
"${compose[@]}" up -d >>"$demo/up.log" 2>&1 || { cat "$demo/up.log" >&2; die "compose up"; }
deadline=$(( $(date +%s) + wait_s ))
online=0
while [ "$online" -lt 3 ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { "${compose[@]}" ps >&2; die "only $online of 3 SuperNodes online after $wait_s s (logs: ${compose[*]} logs supernode-0)"; }
    sleep 2
    online="$("$bindir/flwr" supernode ls "$connection" --format json 2>/dev/null \
        | "$py" -c 'import json, sys; print(sum(n.get("status") == "online" for n in json.load(sys.stdin).get("nodes", [])))' \
        2>/dev/null || echo 0)"
done
up_s=$(elapsed "$t2")
say "federation up: 3 SuperNodes online ${up_s} s after the SuperLink started"

# -- the run -------------------------------------------------------------------------------
run="demo-$(date +%Y%m%d-%H%M%S)"
say "submitting a FedEFC run of $rounds rounds (out-dir /results/$run)"
t3=$(date +%s)
# start-round=1 gamma-thr=1: FedEFC's prestopping may fire within a few rounds (as in the
# quick start); the file's own 3 and 3 need more rounds than a demo takes
fedefc deploy submit "$connection" "$deploy_dir/demo-run-config.toml" --set "rounds=$rounds" \
    --set start-round=1 --set gamma-thr=1 --set "out-dir=\"/results/$run\"" \
    >"$demo/run.log" 2>&1 \
    || { tail -40 "$demo/run.log" >&2; die "the run did not complete (its log above)"; }
run_s=$(elapsed "$t3")
grep -E "SUMMARY|^run [0-9]+:" "$demo/run.log" || true

# -- its results: summary and every node in every round -------------------------------------
container="$("${compose[@]}" ps -q superexec-serverapp)"
docker cp "$container:/results/$run" "$demo/results" >/dev/null
fedefc deploy fetch "$demo/results" "$demo/fetched" || die "the run's out-dir does not hold a completed run"
"$py" - "$demo/fetched" "$rounds" <<'PY' || die "the run's records miss a node's results"
import json, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
summary = json.loads((out / "summary.json").read_text())
records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
trained = {r["round"]: sorted(r.get("partition_ids") or []) for r in records if r["round"] > 0}
assert summary["status"] == "completed", f"summary status {summary['status']!r}"
assert sorted(trained) == list(range(1, rounds + 1)), f"rounds recorded: {sorted(trained)}"
short = {t: ids for t, ids in trained.items() if ids != [0, 1, 2]}
assert not short, f"rounds without all three nodes' results: {short}"
print(f"every round 1..{rounds} aggregated the results of nodes 0, 1, 2; "
      f"final accuracy {summary['final_acc']:.4f}, client failures "
      f"{summary.get('client_failures')}")
PY

# -- the SuperNodes reach the Fleet API only ----------------------------------------------
node="$("${compose[@]}" ps -q supernode-0)"
docker exec -i "$node" python - <<'PY' || die "a SuperNode reaches more than the Fleet API"
import socket, ssl, urllib.error, urllib.request
try:
    socket.getaddrinfo("superlink", 8000)
    raise SystemExit("supernode-0 resolves the SuperLink's name: it shares a network with it")
except socket.gaierror:
    pass
call = urllib.request.Request("https://fleet-front:8443/v1/control/list-runs", data=b"",
                              method="POST")
try:
    urllib.request.urlopen(call, context=ssl.create_default_context(cafile="/certs/ca.crt"),
                           timeout=60)
    raise SystemExit("the Control API answered supernode-0 through the front")
except urllib.error.HTTPError as err:
    assert err.code == 403, f"the front answered /v1/control/list-runs with {err.code}"
print("supernode-0: no route to the SuperLink; the Control API through the front: 403")
PY

say "figures: stand-in images built in ${standins_s} s, SuperExec image in ${build_s} s;" \
    "bring-up ${up_s} s; run of $rounds rounds ${run_s} s"
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E '^(fedefc-superexec|local/flwr-|flwr/)' | sed 's/^/[compose-demo] image /' || true
say "OK: the compose demo ran and completed with every node's results"
