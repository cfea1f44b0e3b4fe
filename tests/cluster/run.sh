#!/usr/bin/env bash
# make test-cluster: the testbed tests (tests/cluster) on a real emulated cluster.
#
# Needs root (network namespaces, links, cgroups, /etc/hosts). Installs iproute2 and
# util-linux with apt-get when ip, tc, nsenter, unshare or setpriv are missing, runs the
# tests with a time limit (MPIPIPE_REQUIRE_CLUSTER=1: they fail rather than skip where a
# testbed cannot be made), and takes any testbed down on the way out, whatever happens.
# Knobs: MPIPIPE_VENV (default .venv), CLUSTER_TEST_TIMEOUT (seconds, default 1800).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
PY=${MPIPIPE_VENV:-$ROOT/.venv}/bin/python
[[ -x $PY ]] || { echo "test-cluster: error: no Python at $PY; run 'make install' first" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "test-cluster: error: the testbed needs root; run make test-cluster as root" >&2; exit 2; }

missing=()
for tool in ip tc nsenter unshare setpriv; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
    echo "test-cluster: installing iproute2 and util-linux (missing: ${missing[*]})"
    log=${TMPDIR:-/tmp}/test-cluster-apt.log
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
               iproute2 util-linux </dev/null; } >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        echo "test-cluster: error: apt-get install iproute2 util-linux failed (log above)" >&2
        exit 1
    fi
fi

trap '"$PY" -m mpipipe testbed down >/dev/null 2>&1 || true' EXIT
MPIPIPE_REQUIRE_CLUSTER=1 timeout "${CLUSTER_TEST_TIMEOUT:-1800}" \
    "$PY" -m pytest -q -p no:cacheprovider tests/cluster
