#!/usr/bin/env bash
# Renew the SuperLink's TLS certificate, keeping its CA (so nothing changes on the
# SuperNodes or for the operators: they trust ca.crt, which stays).
#
# usage: deploy/renew-cert.sh CERT_DIR [--ca-key FILE] [--check DAYS]
#
#   --check DAYS   renew nothing: exit 0 if CERT_DIR/server.pem is valid for more than
#                  DAYS days, else 1 (for a monthly timer or cron job), printing the dates
#   --ca-key FILE  the CA's private key, e.g. on the offline medium it was moved to
#                  (default CERT_DIR/ca.key)
#
# Renewing writes a new key and certificate for the same names (the subjectAltName and
# subject of the current server.pem), valid CERT_DAYS days (default 365) and signed by
# CERT_DIR/ca.crt, checks it against ca.crt, keeps the old pair as server.pem.old and
# server.key.old, and moves the new one into place. The SuperLink reads its certificate
# when it starts: restart it afterwards (its SuperExec restarts with it):
#   sudo systemctl restart fedefc-superlink.service      (or Ctrl-C and start it again)
# A restart ends a run in progress: renew between runs (docs/DEPLOYMENT.md, "Certificates").
set -euo pipefail
umask 077
source "$(dirname "$0")/lib.sh"

usage() { echo "usage: $0 CERT_DIR [--ca-key FILE] [--check DAYS]" >&2; exit 2; }
[ "$#" -ge 1 ] || usage
dir="$1"; shift
ca_key="$dir/ca.key"; check=""
while [ "$#" -gt 0 ]; do
    case "$1" in
        --ca-key) [ "$#" -ge 2 ] || usage; ca_key="$2"; shift 2 ;;
        --check) [ "$#" -ge 2 ] || usage; check="$2"; shift 2 ;;
        *) usage ;;
    esac
done
command -v openssl >/dev/null || { echo "$0: openssl not found; install it" >&2; exit 2; }
for file in "$dir/ca.crt" "$dir/server.pem"; do
    [ -f "$file" ] || { echo "$0: $file not found: give the folder deploy/gen-certs.sh wrote" >&2
                        exit 2; }
done
until_date() { openssl x509 -in "$1" -noout -enddate | cut -d= -f2; }
echo "SuperLink certificate $dir/server.pem valid until $(until_date "$dir/server.pem")"
echo "CA certificate        $dir/ca.crt valid until $(until_date "$dir/ca.crt")"

if [ -n "$check" ]; then
    if openssl x509 -in "$dir/server.pem" -noout -checkend $((check * 86400)) >/dev/null; then
        echo "valid for more than $check days: nothing to do"
        exit 0
    fi
    echo "expires within $check days: renew it with $0 $dir" >&2
    exit 1
fi

[ -f "$ca_key" ] || { echo "$0: the CA key $ca_key is not here; bring it from where it is kept" \
                           "offline and give --ca-key FILE" >&2; exit 2; }
if [ "$(openssl pkey -in "$ca_key" -pubout 2>/dev/null)" != \
     "$(openssl x509 -in "$dir/ca.crt" -noout -pubkey)" ]; then
    echo "$0: $ca_key is not the key of the CA $dir/ca.crt (the SuperNodes trust that CA);" \
         "give that CA's key with --ca-key. Nothing changed." >&2
    exit 1
fi
days="${CERT_DAYS:-365}"
# the current certificate's names: "DNS:a, IP Address:1.2.3.4" -> "DNS:a,IP:1.2.3.4"
san="$(openssl x509 -in "$dir/server.pem" -noout -ext subjectAltName | tail -n +2 \
       | sed -e 's/^ *//' -e 's/IP Address:/IP:/g' -e 's/, /,/g')"
cn="$(openssl x509 -in "$dir/server.pem" -noout -subject -nameopt multiline \
      | sed -n 's/^ *commonName *= *//p')"
[ -n "$san" ] && [ -n "$cn" ] || { echo "$0: cannot read the names of $dir/server.pem" >&2
                                   exit 2; }
sign_server_cert "$dir" "$ca_key" "$san" "$cn" "$days"
if ! openssl verify -CAfile "$dir/ca.crt" "$dir/server.pem.new" >/dev/null; then
    rm -f "$dir/server.pem.new" "$dir/server.key.new"
    echo "$0: the new certificate does not verify against $dir/ca.crt: is $ca_key the key" \
         "of that CA? Nothing changed." >&2
    exit 1
fi
new_end="$(openssl x509 -in "$dir/server.pem.new" -noout -enddate | cut -d= -f2)"
if ! openssl x509 -in "$dir/ca.crt" -noout -checkend $((days * 86400)) >/dev/null; then
    echo "WARNING: the CA expires ($(until_date "$dir/ca.crt")) before the new certificate" \
         "($new_end): TLS fails from then on. Make a new CA in time (deploy/gen-certs.sh)" \
         "and give its ca.crt to every machine." >&2
fi
cp -p "$dir/server.pem" "$dir/server.pem.old"
cp -p "$dir/server.key" "$dir/server.key.old" 2>/dev/null || true
mv "$dir/server.key.new" "$dir/server.key"
mv "$dir/server.pem.new" "$dir/server.pem"
echo "renewed: $dir/server.pem valid until $new_end, names $san (old pair: *.old)"
echo "now restart the SuperLink: sudo systemctl restart fedefc-superlink.service" \
     "(or Ctrl-C and start it again); SuperNodes and operators keep ca.crt"
