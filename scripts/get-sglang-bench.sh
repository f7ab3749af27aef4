#!/usr/bin/env bash
# sglang's own benchmark client (`python -m sglang.bench_serving`) in a virtualenv of its own, outside the
# repo and keyed by sglang's version, so the project's .venv (torch 2.13 CPU) is left as it is. Prints
# the venv's python. Idempotent: a venv whose stamp matches this script's package list is reused.
#   venv: ${DSV4_SGLANG_BENCH_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/sglang-bench/<version>}
#
# sglang is installed --no-deps: its full requirements are the GPU runtime (flashinfer, deep-gemm,
# cutlass, ...). What bench_serving imports is installed instead, each a real package from PyPI, found by
# importing sglang.benchmark.serving until it imports. sglang 0.5.23 imports torch (sglang.srt.utils),
# triton and torchvision (sglang.srt.configs, through sglang.srt.disaggregation.utils). PyPI has no CPU
# build of torchvision (its _C links libtorch_cuda), so this venv takes the torch sglang pins, 2.14.1,
# PyPI's CUDA build with its nvidia-* libraries, and the torchvision built for it: about 6 GB on disk,
# none of it used to compute anything (the client only tokenizes and sends HTTP requests).
set -euo pipefail

version=0.5.23
packages=(
  "torch==2.14.1" "torchvision==0.29.1" # sglang's pin, and torchvision's build for it (brings triton)
  "transformers==5.19.0" "tokenizers==0.23.2" "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
  "apache-tvm-ffi==0.1.11" gguf aiohttp msgspec numpy orjson requests tqdm psutil pybase64 pillow
  pyzmq ipython datasets fastapi
)
dir=${DSV4_SGLANG_BENCH_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/sglang-bench/$version}
want=$(printf '%s\n' "sglang==$version" "${packages[@]}" | sha256sum | cut -d' ' -f1)
stamp=$dir/.dsv4-installed
if [[ "$(cat "$stamp" 2>/dev/null)" == "$want" && -x $dir/bin/python ]]; then
  echo "$dir/bin/python"
  exit 0
fi

mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9 # one install at a time; a second caller waits, then finds the stamp
if [[ "$(cat "$stamp" 2>/dev/null)" == "$want" && -x $dir/bin/python ]]; then
  echo "$dir/bin/python"
  exit 0
fi
echo "get-sglang-bench: installing sglang $version's bench_serving into $dir" >&2
rm -rf "$dir"
"${PYTHON:-python3}" -m venv "$dir"
pip=("$dir/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "${packages[@]}" >&2
"${pip[@]}" --no-deps "sglang==$version" >&2
# The check the stamp stands for: the client imports (a missing module fails here, not in a test).
(cd "$dir" && HF_HUB_OFFLINE=1 "$dir/bin/python" -W ignore -c "import sglang.bench_serving") >&2
echo "$want" >"$stamp"
echo "$dir/bin/python"
