#!/usr/bin/env bash
# Generate one SuperNode authentication key pair per node (ECDSA P-384, OpenSSH format).
#
# usage: deploy/gen-node-keys.sh OUT_DIR NODE_NAME [NODE_NAME ...]
#
# Writes OUT_DIR/NODE_NAME (private key: stays on that SuperNode, passed with
# --auth-supernode-private-key) and OUT_DIR/NODE_NAME.pub (public key: give it to the
# SuperLink operator, who registers it with deploy/register-nodes.sh).
# Refuses to overwrite an existing key.
set -euo pipefail

if [ "$#" -lt 2 ]; then
    echo "usage: $0 OUT_DIR NODE_NAME [NODE_NAME ...]" >&2
    echo "e.g.:  $0 ./keys node-0 node-1 node-2" >&2
    exit 2
fi
command -v ssh-keygen >/dev/null || {
    echo "$0: ssh-keygen not found; install openssh-client" >&2; exit 2; }

out="$1"; shift
mkdir -p "$out"
chmod 700 "$out"
for name in "$@"; do
    if [[ ! "$name" =~ ^[A-Za-z0-9._-]+$ ]]; then
        echo "$0: node name '$name' may only hold letters, digits, '.', '_' and '-'" >&2
        exit 2
    fi
    if [ -e "$out/$name" ] || [ -e "$out/$name.pub" ]; then
        echo "$0: $out/$name already exists; nothing overwritten" >&2
        exit 2
    fi
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedefc-$name" -f "$out/$name"
    echo "$name: private $out/$name (stays on the node)  public $out/$name.pub (register it)"
done
