#!/usr/bin/env bash
# Start the SuperLink and its SuperExec (ServerApps) in the foreground; Ctrl-C (or SIGTERM)
# stops both. Their logs go to STATE_DIR/superlink.log and STATE_DIR/superexec.log.
# Run on the SuperLink machine with the Python environment where this project is
# installed: the active one, else this checkout's .venv, else $PYTHON (deploy/lib.sh).
# Options: fedefc deploy superlink --help
# e.g. deploy/start-superlink.sh --certs ~/.fedefc/certs --node-auth \
#        --superexec-secret ~/.fedefc/superlink.secret
set -euo pipefail
source "$(dirname "$0")/lib.sh"
py="$(fedefc_python)"
exec "$py" -m fedefc_cli deploy superlink "$@"
