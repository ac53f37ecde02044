#!/usr/bin/env bash
# Generate one SuperNode authentication key pair per node (ECDSA P-384, OpenSSH format).
#
# usage: deploy/gen-node-keys.sh OUT_DIR NODE_NAME [NODE_NAME ...]
#
# Writes OUT_DIR/NODE_NAME (private key: stays on that SuperNode, passed with
# --auth-supernode-private-key) and OUT_DIR/NODE_NAME.pub (public key: give it to the
# SuperLink operator, who registers it with deploy/register-nodes.sh).
# Refuses to overwrite an existing key, and to write a private key where `git add -A`
# would commit it (inside a git work tree and not git-ignored): use e.g. ~/.fedefc/keys.
# Created owner-only (umask 077: folder 0700, private key 0600; the .pub is 0644).
set -euo pipefail
umask 077
source "$(dirname "$0")/lib.sh"

if [ "$#" -lt 2 ]; then
    echo "usage: $0 OUT_DIR NODE_NAME [NODE_NAME ...]" >&2
    echo "e.g.:  $0 ~/.fedefc/keys node-0" >&2
    exit 2
fi
command -v ssh-keygen >/dev/null || {
    echo "$0: ssh-keygen not found; install openssh-client" >&2; exit 2; }

out="$1"; shift
for name in "$@"; do
    if [[ ! "$name" =~ ^[A-Za-z0-9._-]+$ ]]; then
        echo "$0: node name '$name' may only hold letters, digits, '.', '_' and '-'" >&2
        exit 2
    fi
    if [ -e "$out/$name" ] || [ -e "$out/$name.pub" ]; then
        echo "$0: $out/$name already exists; nothing overwritten" >&2
        exit 2
    fi
    private_location "$out/$name"
done
mkdir -p "$out"
chmod 700 "$out"
for name in "$@"; do
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedefc-$name" -f "$out/$name"
    chmod 600 "$out/$name"
    chmod 644 "$out/$name.pub"
    echo "$name: private $out/$name (stays on the node)  public $out/$name.pub (register it)"
done
