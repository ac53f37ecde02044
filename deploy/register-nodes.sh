#!/usr/bin/env bash
# Register SuperNode public keys with a SuperLink started with --enable-supernode-auth
# (fedefc deploy register: waits until the SuperLink answers, refuses a private key).
#
# usage: deploy/register-nodes.sh CONNECTION PUBLIC_KEY [PUBLIC_KEY ...]
#
# CONNECTION is a `[superlink.CONNECTION]` entry of $FLWR_HOME/config.toml (default
# ~/.flwr/config.toml) that points at the SuperLink with TLS (root-certificates = the
# CA certificate); `fedefc deploy connection` writes one. Each key is registered under
# its file's name (node-0.pub -> node-0). A SuperNode whose public key is not
# registered is refused (flower-supernode exits with code 305, "code: 2004").
# Runs with the Python environment deploy/lib.sh finds (as the start-*.sh scripts).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
py="$(fedefc_python)"
exec "$py" -m fedefc_cli deploy register "$@"
