#!/usr/bin/env bash
# Start a SuperNode and its SuperExec (ClientApps) in the foreground; Ctrl-C (or SIGTERM)
# stops both. Their logs go to STATE_DIR/supernode.log and STATE_DIR/superexec.log.
# Run on each client machine with the Python environment where this project is
# installed: the active one, else this checkout's .venv, else $PYTHON (deploy/lib.sh).
# Options: fedefc deploy supernode --help
# e.g. deploy/start-supernode.sh --superlink superlink.example.org:8000 \
#        --partition-id 0 --num-partitions 3 --ca-cert ~/.fedefc/certs/ca.crt \
#        --auth-key ~/.fedefc/keys/node-0 --superexec-secret ~/.fedefc/node-0.secret
set -euo pipefail
source "$(dirname "$0")/lib.sh"
py="$(fedefc_python)"
exec "$py" -m fedefc_cli deploy supernode "$@"
