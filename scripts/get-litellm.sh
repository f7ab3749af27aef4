#!/usr/bin/env bash
# LiteLLM (an OpenAI-compatible client users put in front of servers) in a virtualenv of its own,
# outside the repo and keyed by its version; prints the venv's python. Idempotent (a stamp marks a
# finished install; one install at a time). Its own venv because no LiteLLM release fits the project's
# .venv: the ones that accept openai 3.x pull boto3, whose botocore caps python-dateutil below the 3.x
# kubernetes 37 needs (tests/server/test_server_litellm.py).
#   venv: ${DSV4_LITELLM_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/litellm/<version>}
set -euo pipefail

version=1.110.2
dir=${DSV4_LITELLM_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/litellm/$version}
stamp=$dir/.dsv4-installed
installed() { [[ "$(cat "$stamp" 2>/dev/null)" == "litellm==$version" && -x $dir/bin/python ]]; }
if installed; then echo "$dir/bin/python"; exit 0; fi
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
if installed; then echo "$dir/bin/python"; exit 0; fi
echo "get-litellm: installing litellm $version into $dir" >&2
"${PYTHON:-python3}" -m venv --clear "$dir"
"$dir/bin/python" -m pip install -q --disable-pip-version-check "litellm==$version" >&2
"$dir/bin/python" -c "import litellm" >&2
echo "litellm==$version" >"$stamp"
echo "$dir/bin/python"
