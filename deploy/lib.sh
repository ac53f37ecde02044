# Sourced by the deploy/*.sh scripts (not run on its own).
#
# fedefc_python: the interpreter that runs this project, in this order: $PYTHON; the
#   active virtual environment ($VIRTUAL_ENV); the checkout's .venv (the one
#   docs/DEPLOYMENT.md's Install step creates); python3 on PATH.
# private_location FILE: refuse to write a private key or secret where `git add -A`
#   would commit it (inside a git work tree and not git-ignored).

deploy_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
checkout="$(dirname "$deploy_dir")"

fedefc_python() {
    local py
    if [ -n "${PYTHON:-}" ]; then
        py="$PYTHON"
    elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
        py="$VIRTUAL_ENV/bin/python"
    elif [ -x "$checkout/.venv/bin/python" ]; then
        py="$checkout/.venv/bin/python"
    else
        py=python3
    fi
    if ! command -v "$py" >/dev/null; then
        echo "$0: no Python interpreter '$py'. Install this project in a virtual environment" \
             "(docs/DEPLOYMENT.md, Install) and activate it (source .venv/bin/activate)," \
             "or name its interpreter: PYTHON=/path/to/.venv/bin/python $0 ..." >&2
        exit 2
    fi
    echo "$py"
}

private_location() {
    local file="$1" dir
    dir="$(dirname "$file")"
    while [ ! -d "$dir" ]; do dir="$(dirname "$dir")"; done
    command -v git >/dev/null || return 0
    git -C "$dir" rev-parse --is-inside-work-tree >/dev/null 2>&1 || return 0
    local abs
    abs="$(cd "$dir" && pwd)/${file#"$dir"/}"
    if ! git -C "$dir" check-ignore -q "$abs"; then
        echo "$0: refusing to write $file: it is inside the git work tree" \
             "$(git -C "$dir" rev-parse --show-toplevel) and not git-ignored, so" \
             "'git add -A' would commit it. Write it outside the work tree (e.g. under" \
             "~/.fedefc/) or git-ignore it first; nothing written." >&2
        exit 2
    fi
}

# sign_server_cert DIR CA_KEY SAN CN DAYS: a new SuperLink key DIR/server.key.new and
#   certificate DIR/server.pem.new (subjectAltName SAN, e.g. "DNS:localhost,IP:127.0.0.1";
#   common name CN; DAYS valid), signed by DIR/ca.crt with CA_KEY (gen-certs.sh,
#   renew-cert.sh). The caller moves them into place.
sign_server_cert() {
    local dir="$1" ca_key="$2" san="$3" cn="$4" days="$5" ext
    ext="$(mktemp)"
    cat > "$ext" <<EXT
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = $san
EXT
    (umask 077 && openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-384 \
        -out "$dir/server.key.new" 2>/dev/null)
    openssl req -new -key "$dir/server.key.new" -subj "/CN=$cn" -out "$dir/server.csr"
    openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$ca_key" \
        -CAcreateserial -days "$days" -sha384 -extfile "$ext" -out "$dir/server.pem.new" \
        2>/dev/null
    rm -f "$ext" "$dir/server.csr" "$dir/ca.srl"
    chmod 600 "$dir/server.key.new"
    chmod 644 "$dir/server.pem.new"
}
