#!/usr/bin/env bash
# Generate the coordinator's app-signing key (Ed25519, OpenSSH format) and the trusted
# keys file every SuperNode (and the SuperLink machine) is started with.
#
# usage: deploy/gen-signing-key.sh OUT_DIR KEY_NAME
#
# Writes OUT_DIR/KEY_NAME (private: stays with the coordinator, who submits with
# `fedefc deploy submit --sign-key OUT_DIR/KEY_NAME`), OUT_DIR/KEY_NAME.pub, and
# OUT_DIR/KEY_NAME.trusted.yaml, one line `KEY_NAME: "ssh-ed25519 AAAA..."` (Flower's
# --trusted-entities format): copy it to every machine and start its SuperNode or
# SuperLink with --trusted-keys FILE; they then run only apps signed with this key
# (docs/DEPLOYMENT.md, "Outsiders on the network").
# Refuses to overwrite, and to write the private key where `git add -A` would commit it.
# Created owner-only (umask 077: folder 0700, private key 0600; the others 0644).
set -euo pipefail
umask 077
source "$(dirname "$0")/lib.sh"

if [ "$#" -ne 2 ]; then
    echo "usage: $0 OUT_DIR KEY_NAME" >&2
    echo "e.g.:  $0 ~/.fedefc/keys coordinator" >&2
    exit 2
fi
command -v ssh-keygen >/dev/null || {
    echo "$0: ssh-keygen not found; install openssh-client" >&2; exit 2; }
out="$1"; name="$2"
if [[ ! "$name" =~ ^[A-Za-z0-9._-]+$ ]]; then
    echo "$0: key name '$name' may only hold letters, digits, '.', '_' and '-'" >&2
    exit 2
fi
for file in "$out/$name" "$out/$name.pub" "$out/$name.trusted.yaml"; do
    if [ -e "$file" ]; then
        echo "$0: $file already exists; nothing overwritten" >&2
        exit 2
    fi
done
private_location "$out/$name"
mkdir -p "$out"
chmod 700 "$out"
ssh-keygen -q -t ed25519 -N "" -C "fedefc-$name" -f "$out/$name"
printf '%s: "%s"\n' "$name" "$(cut -d' ' -f1,2 "$out/$name.pub")" > "$out/$name.trusted.yaml"
chmod 600 "$out/$name"
chmod 644 "$out/$name.pub" "$out/$name.trusted.yaml"
echo "signing key: $out/$name (the coordinator's; fedefc deploy submit --sign-key)"
echo "trusted:     $out/$name.trusted.yaml (copy to every machine; --trusted-keys)"
