#!/usr/bin/env bash
# The test command: set up everything the suite needs, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Real Kubernetes tier: kube-apiserver and kube-controller-manager built once from Debian's source
# package, cached outside the repo by version (skipped when DSV4_KUBE_* point at prebuilt ones).
bash scripts/build-kube.sh
# sglang's bench_serving client in a venv of its own, cached by version outside the repo
# (tests/server/test_server_bench_serving.py): it needs torch 2.14.1 and torchvision, not .venv's
# torch, so only the tests install it, never the main command. About 6 GB: a machine that cannot hold
# it still runs the suite, and that one test says why it skipped.
bash scripts/get-sglang-bench.sh >/dev/null || echo "test.sh: sglang bench_serving not installed (its test will skip)" >&2
source .venv/bin/activate
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
ruff check .
ruff format --check . || { echo "ruff format: run 'ruff format .'"; exit 1; }
exec python -m pytest -q --durations=25 "$@"
