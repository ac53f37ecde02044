#!/usr/bin/env bash
# Generate a SuperExec shared secret: a SuperLink or SuperNode started with
# --superexec-auth-secret-file FILE only lets a SuperExec holding the same FILE run its
# ServerApps / ClientApps. One secret per SuperLink/SuperNode + SuperExec pair; it never
# leaves the machine (or the compose project) of that pair.
#
# usage: deploy/gen-secret.sh FILE [FILE ...]      (refuses to overwrite)
#   e.g. deploy/gen-secret.sh ~/.fedefc/superlink.secret      (on the SuperLink machine)
#        deploy/gen-secret.sh ~/.fedefc/node-0.secret         (on client machine 0)
# Created owner-only (umask 077: 0600, new folders 0700); refuses a FILE where
# `git add -A` would commit it (inside a git work tree and not git-ignored).
set -euo pipefail
umask 077
source "$(dirname "$0")/lib.sh"

if [ "$#" -lt 1 ]; then
    echo "usage: $0 FILE [FILE ...]" >&2
    exit 2
fi
command -v openssl >/dev/null || { echo "$0: openssl not found; install it" >&2; exit 2; }
for file in "$@"; do
    if [ -e "$file" ]; then
        echo "$0: $file already exists; nothing overwritten" >&2
        exit 2
    fi
    private_location "$file"
    mkdir -p "$(dirname "$file")"
    openssl rand -hex 32 | tr -d '\n' > "$file"
    echo "secret: $file"
done
