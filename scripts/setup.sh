#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: system packages, a virtualenv in .venv, the project with
# every extra. A second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

# Mooncake's TCP transport links libibverbs and libnuma even without RDMA hardware; iproute2's `ip`
# makes the cluster tier's pod network namespaces and nftables' `nft` enforces its NetworkPolicies
# (tests/cluster).
apt_pkgs=(libibverbs1 libnuma1 openssl iperf3 prometheus iproute2 nftables)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "setup: apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
stamp=.venv/.dsv4-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  echo "setup: installing the project and its extras into .venv"
  .venv/bin/pip install -q --upgrade pip
  # The CPU build of torch first, so the engine extra's range is already satisfied.
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e '.[engine,operator,test,bench,eval]'
  echo "$want" > "$stamp"
fi

# The engine's fused CPU kernels, built once per source and torch version into the cache outside the
# repo ($XDG_CACHE_HOME/dsv4/kernels): otherwise the first servers to start build them, and every
# other start waits on that build (minutes on two busy cores). Where no compiler works, the engine
# runs its torch forms, slower.
TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python -m dsv4_engine.kernels >/dev/null ||
  echo "setup: the fused CPU kernels could not be built; the engine runs its torch forms" >&2
