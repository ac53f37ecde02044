#!/usr/bin/env bash
# Register SuperNode public keys with a SuperLink started with --enable-supernode-auth.
#
# usage: deploy/register-nodes.sh CONNECTION PUBLIC_KEY [PUBLIC_KEY ...]
#
# CONNECTION is a `[superlink.CONNECTION]` entry of $FLWR_HOME/config.toml (default
# ~/.flwr/config.toml) that points at the SuperLink with TLS (root-certificates = the
# CA certificate); `fedefc deploy connection` writes one. A SuperNode
# whose public key is not registered is refused (flower-supernode exits with code 305).
# Runs the flwr CLI of the environment deploy/lib.sh finds (as the start-*.sh scripts).
set -euo pipefail
source "$(dirname "$0")/lib.sh"

if [ "$#" -lt 2 ]; then
    echo "usage: $0 CONNECTION PUBLIC_KEY [PUBLIC_KEY ...]" >&2
    echo "e.g.:  $0 fedefc node-0.pub node-1.pub node-2.pub" >&2
    exit 2
fi
connection="$1"; shift
for key in "$@"; do
    if [ ! -f "$key" ]; then
        echo "$0: public key $key not found (nothing registered)" >&2
        exit 2
    fi
    if grep -q "PRIVATE KEY" "$key"; then
        echo "$0: $key is a private key; register its public key ($key.pub) instead, and" \
             "keep the private key on its node (nothing registered)" >&2
        exit 2
    fi
done
flwr="$(fedefc_flwr)"
for key in "$@"; do
    "$flwr" supernode register "$key" "$connection" --name "$(basename "$key" .pub)"
done
