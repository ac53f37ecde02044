#!/usr/bin/env bash
# Build a local Debian + Python base image without any container registry:
# debootstrap (minbase) from the Debian mirror -> tar -> `docker import`.
# The base of deploy/flwr-standins.Dockerfile where no registry is reachable
# (docs/DEPLOYMENT.md, "Docker Compose demo").
# Idempotent: an existing image tag is kept (FORCE=1 rebuilds it), an existing
# complete rootfs is reused (FORCE_ROOTFS=1 re-debootstraps it).
#
# Env (defaults):
#   TAG=local/debian-python:bookworm   SUITE=bookworm
#   MIRROR=http://deb.debian.org/debian
#   PACKAGES=python3,python3-venv,ca-certificates
#   WORK=${TMPDIR:-/tmp}/fedefc-base-image   (rootfs cache, ~275 MB)
#   EXTRA_CA=auto   auto|yes|no: copy /usr/local/share/ca-certificates/*.crt into the
#                   image (needed here: HTTPS to PyPI goes through a TLS-intercepting
#                   egress proxy whose CA only the host trusts)
# Needs: root, debootstrap, docker (a running daemon).
set -euo pipefail

TAG="${TAG:-local/debian-python:bookworm}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
PACKAGES="${PACKAGES:-python3,python3-venv,ca-certificates}"
WORK="${WORK:-${TMPDIR:-/tmp}/fedefc-base-image}"
EXTRA_CA="${EXTRA_CA:-auto}"
ROOTFS="$WORK/rootfs-$SUITE"
MARK="$ROOTFS/.debootstrap-complete"

say() { printf '[make-base-image] %s\n' "$*"; }

[ "$(id -u)" = 0 ] || { say "must run as root (debootstrap, chroot)"; exit 2; }
command -v debootstrap >/dev/null || { say "installing debootstrap"; apt-get install -y --no-install-recommends debootstrap; }
docker info >/dev/null 2>&1 || { say "no Docker daemon reachable (docker info failed)"; exit 2; }

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    say "image $TAG exists ($(docker image inspect -f '{{.Id}}' "$TAG")); FORCE=1 rebuilds it"
    docker run --rm "$TAG" python3 -V
    exit 0
fi

mkdir -p "$WORK"
if [ "${FORCE_ROOTFS:-0}" = 1 ] || [ ! -f "$MARK" ]; then
    say "debootstrap --variant=minbase --include=$PACKAGES $SUITE $ROOTFS $MIRROR (takes minutes)"
    rm -rf "$ROOTFS"
    start=$(date +%s)
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR"
    say "debootstrap took $(( $(date +%s) - start )) s"
    # apt inside the image uses the same mirror
    echo "deb $MIRROR $SUITE main" > "$ROOTFS/etc/apt/sources.list"
    touch "$MARK"
else
    say "reusing rootfs $ROOTFS (FORCE_ROOTFS=1 re-debootstraps)"
fi

# Extra CAs (idempotent: the folder is re-synced each time).
cas=(/usr/local/share/ca-certificates/*.crt)
if [ "$EXTRA_CA" = yes ] || { [ "$EXTRA_CA" = auto ] && [ -e "${cas[0]}" ]; }; then
    say "adding host CA certificates: ${cas[*]}"
    rm -rf "$ROOTFS/usr/local/share/ca-certificates"
    mkdir -p "$ROOTFS/usr/local/share/ca-certificates"
    cp "${cas[@]}" "$ROOTFS/usr/local/share/ca-certificates/"
    chroot "$ROOTFS" update-ca-certificates --fresh >/dev/null
else
    say "no extra CA certificates added"
fi

say "cleaning apt caches in the rootfs"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log

say "importing $ROOTFS as $TAG"
tar --numeric-owner --exclude=./.debootstrap-complete -C "$ROOTFS" -c . \
    | docker import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["python3"]' \
        - "$TAG"
say "check: docker run --rm $TAG python3 -V"
docker run --rm "$TAG" python3 -V
docker image ls "$TAG"
