#!/usr/bin/env bash
# make test-stress: `make test` three times in a row with two busy loops beside it, on a
# 2-core machine: a test that depends on timing, load or luck fails here first.
set -euo pipefail
cd "$(dirname "$0")/.."
busy=()
cleanup() { for p in "${busy[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in 1 2; do
  ( while :; do :; done ) &
  busy+=("$!")
done
for i in 1 2 3; do
  echo "== make test, run $i of 3, with two busy loops =="
  make test
done
echo "== make test-stress: 3 of 3 passed =="
