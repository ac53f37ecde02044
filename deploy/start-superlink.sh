#!/usr/bin/env bash
# Start the SuperLink and its SuperExec (ServerApps) in the foreground; Ctrl-C stops both.
# Run on the SuperLink machine, in an environment where this project is installed
# (pip install -e .). Options: fedefc deploy superlink --help
# e.g. deploy/start-superlink.sh --certs ./certs --node-auth --superexec-secret ./link.secret
exec "${PYTHON:-python}" -m fedefc_cli deploy superlink "$@"
