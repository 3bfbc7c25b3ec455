#!/usr/bin/env bash
# Write the cluster secret that compose.yaml mounts into every kvflow container, once:
# 32 random bytes as hex, in a directory only this user may enter (the file itself is
# readable by the containers' user, uid 10001, through the bind mount). An existing
# secret is kept: the running cluster's processes must all share the same one.
#
#   docker/make_cluster_secret.sh [PATH]    (default: .kvflow-secrets/cluster_secret)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SECRET="${1:-${KVFLOW_CLUSTER_SECRET:-$REPO/.kvflow-secrets/cluster_secret}}"
if [[ -s "$SECRET" ]]; then
    exit 0
fi
install -d -m 0700 "$(dirname "$SECRET")"
umask 022
python3 -c 'import secrets; print(secrets.token_hex(32))' >"$SECRET.tmp"
mv "$SECRET.tmp" "$SECRET"
echo "wrote the cluster secret $SECRET" >&2
