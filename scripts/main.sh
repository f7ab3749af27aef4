#!/usr/bin/env bash
# The main job on a fresh machine: install, start the local PD cluster with `dsv4 up` (the bundled CPU
# example: one prefill and one decode server on the bundled demo model, which answers questions about
# Python in English, paired behind sglang-router on 127.0.0.1), ask it through the router with the
# official openai client, then stop it with SIGTERM: it drains and must exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .venv/bin/activate
export TORCH_DEVICE_BACKEND_AUTOLOAD=0

run=$(mktemp -d)
# Free ports, so the demo runs beside anything already listening on the spec's (8000, 30000, ...).
echo "== dsv4 up --ports free"
dsv4 up --ports free > >(tee "$run/up.out") 2>&1 &
up=$!
trap 'kill -TERM $up 2>/dev/null || true; wait $up 2>/dev/null || true; rm -rf "$run"' EXIT
python scripts/demo_client.py --up-output "$run/up.out" --pid "$up" --model dsv4-tiny

echo "== kill -TERM $up (dsv4 up drains the servers, then stops the router)"
kill -TERM "$up"
status=0
wait "$up" || status=$?
trap 'rm -rf "$run"' EXIT
if [[ $status -ne 0 ]]; then
    echo "dsv4 up exited with status $status" >&2
    exit 1
fi
echo "== dsv4 up exited 0"
