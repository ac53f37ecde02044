#!/usr/bin/env bash
# Start a SuperNode and its SuperExec (ClientApps) in the foreground; Ctrl-C stops both.
# Run on each client machine, in an environment where this project is installed
# (pip install -e .). Options: fedefc deploy supernode --help
# e.g. deploy/start-supernode.sh --superlink superlink.example.org:8000 \
#        --partition-id 0 --num-partitions 3 --data-path /srv/data/train.npz \
#        --ca-cert ./ca.crt --auth-key ./keys/node-0 --superexec-secret ./node.secret
exec "${PYTHON:-python}" -m fedefc_cli deploy supernode "$@"
