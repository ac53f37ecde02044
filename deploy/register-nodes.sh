#!/usr/bin/env bash
# Register SuperNode public keys with a SuperLink started with --enable-supernode-auth.
#
# usage: deploy/register-nodes.sh CONNECTION PUBLIC_KEY [PUBLIC_KEY ...]
#
# CONNECTION is a `[superlink.CONNECTION]` entry of $FLWR_HOME/config.toml (default
# ~/.flwr/config.toml) that points at the SuperLink with TLS (root-certificates = the
# CA certificate); `fedefc deploy connection` writes one. A SuperNode
# whose public key is not registered is refused (flower-supernode exits with code 305).
set -euo pipefail

if [ "$#" -lt 2 ]; then
    echo "usage: $0 CONNECTION PUBLIC_KEY [PUBLIC_KEY ...]" >&2
    echo "e.g.:  $0 fedefc ./keys/node-0.pub ./keys/node-1.pub" >&2
    exit 2
fi
connection="$1"; shift
for key in "$@"; do
    if [ ! -f "$key" ]; then
        echo "$0: public key $key not found" >&2
        exit 2
    fi
    name="$(basename "$key" .pub)"
    flwr supernode register "$key" "$connection" --name "$name"
done
