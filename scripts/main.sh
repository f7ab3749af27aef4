#!/usr/bin/env bash
# The main job on a fresh machine: install, write the tiny model, serve it with the OpenAI-compatible
# server on 127.0.0.1, and show it answering through the official openai client.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source .venv/bin/activate
export TORCH_DEVICE_BACKEND_AUTOLOAD=0

cache=${XDG_CACHE_HOME:-$HOME/.cache}/dsv4
model=${DSV4_DEMO_MODEL:-$cache/models/tiny-seed0}
[[ -f "$model/config.json" ]] || dsv4 make-tiny "$model" --preset tiny --seed 0
port=${DSV4_DEMO_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

echo "== dsv4 serve --model $model --port $port"
dsv4 serve --model "$model" --served-model-name dsv4-tiny --host 127.0.0.1 --port "$port" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
python scripts/demo_client.py --base-url "http://127.0.0.1:$port/v1" --model dsv4-tiny --server-pid "$server"
