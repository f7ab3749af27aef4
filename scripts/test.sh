#!/usr/bin/env bash
# The test command: set up everything the suite needs, then run the whole suite. Every tier runs: a
# test that skips for a missing tool fails the run (DSV4_REQUIRE_REAL_KUBE, tests/suite/skips.py);
# only the hardware skips listed there are allowed, and the run ends by listing every skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Real Kubernetes tier: kube-apiserver and kube-controller-manager built once from Debian's source
# package, cached outside the repo by version (skipped when DSV4_KUBE_* point at prebuilt ones).
bash scripts/build-kube.sh
# helm and kubectl, pinned, cached outside the repo (scripts/get-kube-clients.sh).
clients=$(bash scripts/get-kube-clients.sh)
export DSV4_HELM=$clients/helm KUBECTL=$clients/kubectl
# The cluster tier enforces NetworkPolicies on bridged pod traffic, which needs br_netfilter; where it
# is neither built in nor loadable, those tests skip saying so (a hardware skip).
if [[ ! -e /proc/sys/net/bridge/bridge-nf-call-iptables ]]; then
  modprobe br_netfilter 2>/dev/null || echo "test.sh: br_netfilter cannot be loaded: NetworkPolicy enforcement will skip" >&2
fi
# sglang's bench_serving client in a venv of its own, cached by version outside the repo
# (tests/server/test_server_bench_serving.py): it needs torch 2.14.1 and torchvision, not .venv's
# torch, so only the tests install it, never the main command (about 6 GB). Where it cannot be
# installed, its test fails saying why.
bash scripts/get-sglang-bench.sh >/dev/null || echo "test.sh: sglang bench_serving not installed (its test will fail)" >&2
# LiteLLM, a client users put in front of servers, in a venv of its own for the same reason (no release
# of it fits .venv's pins); tests/server/test_server_litellm.py.
bash scripts/get-litellm.sh >/dev/null || echo "test.sh: LiteLLM not installed (its test will fail)" >&2
source .venv/bin/activate
export TORCH_DEVICE_BACKEND_AUTOLOAD=0 DSV4_REQUIRE_REAL_KUBE=1
ruff check .
ruff format --check . || { echo "ruff format: run 'ruff format .'"; exit 1; }
# Two workers (the machine's two cores): much of the suite waits on servers and API servers it starts.
exec python -m pytest -q -n 2 --durations=25 "$@"
