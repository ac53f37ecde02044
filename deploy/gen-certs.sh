#!/usr/bin/env bash
# Generate a private CA and a TLS certificate for the SuperLink (openssl).
#
# usage: deploy/gen-certs.sh OUT_DIR NAME_OR_IP [NAME_OR_IP ...]
#
# Every NAME_OR_IP becomes a subjectAltName of the SuperLink certificate (DNS:name or
# IP:address): list the host name AND the IP address the SuperNodes and the `flwr` CLI
# use to reach the SuperLink (and `superlink` for the compose demo). `localhost` and
# 127.0.0.1 are always added, so the SuperLink's own SuperExec and an operator on the
# SuperLink machine can connect.
#
# Write them outside the checkout (e.g. ~/.fedefc/certs) or to a git-ignored folder: the
# script refuses a folder where `git add -A` would commit the private keys. Everything is
# created owner-only (umask 077; folder 0700, keys 0600); the certificates are then made
# world-readable (0644), as they are public.
#
# Writes (refuses to overwrite an existing CA):
#   OUT_DIR/ca.crt      the CA certificate: copy it to every SuperNode and CLI user
#   OUT_DIR/ca.key      the CA private key: keep it offline, never copy it anywhere
#   OUT_DIR/server.pem  the SuperLink certificate      (--ssl-certfile)
#   OUT_DIR/server.key  the SuperLink private key      (--ssl-keyfile; SuperLink only)
# The SuperLink also takes --ssl-ca-certfile OUT_DIR/ca.crt.
#
# Lifetimes: the CA CA_DAYS (default 3650), the SuperLink certificate CERT_DAYS (default
# 365). Renew the SuperLink certificate before it expires, keeping the CA (nothing to
# change on the SuperNodes): deploy/renew-cert.sh OUT_DIR.
set -euo pipefail
umask 077
source "$(dirname "$0")/lib.sh"

if [ "$#" -lt 2 ]; then
    echo "usage: $0 OUT_DIR NAME_OR_IP [NAME_OR_IP ...]" >&2
    echo "e.g.:  $0 ~/.fedefc/certs superlink.example.org 203.0.113.7" >&2
    exit 2
fi
command -v openssl >/dev/null || { echo "$0: openssl not found; install it" >&2; exit 2; }

out="$1"; shift
days="${CERT_DAYS:-365}"
ca_days="${CA_DAYS:-3650}"
if [ -e "$out/ca.key" ]; then
    echo "$0: $out/ca.key already exists; choose a new OUT_DIR (nothing overwritten)" >&2
    exit 2
fi
private_location "$out/ca.key"
private_location "$out/server.key"
mkdir -p "$out"
chmod 700 "$out"

# subjectAltName list, without duplicates; IPv4/IPv6 literals become IP entries.
declare -A seen=()
san=""
for entry in "$@" localhost 127.0.0.1; do
    [ -n "${seen[$entry]:-}" ] && continue
    seen[$entry]=1
    if [[ "$entry" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$entry" == *:* ]]; then
        san+="${san:+,}IP:$entry"
    else
        san+="${san:+,}DNS:$entry"
    fi
done

openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-384 -out "$out/ca.key" 2>/dev/null
openssl req -x509 -new -key "$out/ca.key" -sha384 -days "$ca_days" \
    -subj "/CN=FedEFC SuperLink CA" -out "$out/ca.crt"
sign_server_cert "$out" "$out/ca.key" "$san" "$1" "$days"
mv "$out/server.key.new" "$out/server.key"
mv "$out/server.pem.new" "$out/server.pem"
chmod 600 "$out/ca.key" "$out/server.key"
chmod 644 "$out/ca.crt" "$out/server.pem"

echo "CA:          $out/ca.crt (distribute)  $out/ca.key (keep offline)"
echo "SuperLink:   $out/server.pem  $out/server.key"
echo "SAN:         $san"
echo "valid:       CA $ca_days days, SuperLink certificate $days days (deploy/renew-cert.sh)"
