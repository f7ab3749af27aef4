"""The e2e tier's in-cluster load: a steady load sent from a pod, where the endpoint Service's
cluster DNS name resolves and kube-proxy spreads connections over its ready addresses (a
`kubectl port-forward` sticks to the one pod it picked, which a rollout deletes).

Run in a pod of the engine image, which has httpx but not openai, as
`python3 -c SOURCE URL WORKERS BODY [STOPFILE]`: WORKERS threads each send one streamed chat (BODY,
the JSON of a /chat/completions request) after another to URL (".../v1"), a new connection each
time so that every request is routed afresh, until the file STOPFILE (default STOP) exists. Each
outcome is one JSON line on stdout: {"ok": true, "text": ...} or {"ok": false, "error": type,
"message": ...}; when every thread has ended its current request, one {"done": count} line, and
the process exits 0.

`outcomes` and `finished` read those lines back from the pod's log (httpx is imported only where a
request is sent).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

STOP = "/tmp/dsv4-load-stop"


def chat(url: str, body: dict[str, Any], timeout: float) -> str:
    """One streamed chat: the text of its deltas. Raises on an HTTP error, an error event in the
    stream (the openai client raises on those too) or a stream that ends before `[DONE]`."""
    import httpx

    parts: list[str] = []
    with (
        httpx.Client(timeout=timeout) as http,
        http.stream("POST", f"{url}/chat/completions", json=body) as r,
    ):
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            data = line.removeprefix("data:").strip() if line.startswith("data:") else None
            if data == "[DONE]":
                return "".join(parts)
            if data:
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise RuntimeError(f"error event: {chunk['error']}")
                parts += [(c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or []]
    raise RuntimeError(f"the stream ended before [DONE] after {''.join(parts)!r}")


def run(url: str, workers: int, body: dict[str, Any], stop: str = STOP, timeout: float = 120) -> int:
    """The load until `stop` exists; returns how many outcomes it printed."""
    lock, count = threading.Lock(), [0]

    def emit(record: dict[str, Any]) -> None:
        with lock:  # one whole line at a time from every thread
            print(json.dumps(record), flush=True)
            count[0] += 1

    def loop() -> None:
        while not os.path.exists(stop):
            try:
                emit({"ok": True, "text": chat(url, body, timeout)})
            except Exception as exc:  # recorded, judged by the test
                emit({"ok": False, "error": type(exc).__name__, "message": str(exc)[:500]})

    threads = [threading.Thread(target=loop) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"done": count[0]}), flush=True)
    return count[0]


def _records(log: str) -> list[dict[str, Any]]:
    """The JSON object lines of a log; anything else the container wrote (warnings) is skipped."""
    out = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def outcomes(log: str) -> list[tuple[str, str]]:
    """Every outcome in order, shaped as `serving.Load.results`: ("ok", text) or (error type,
    message)."""
    return [("ok", r["text"]) if r["ok"] else (r["error"], r["message"]) for r in _records(log) if "ok" in r]


def finished(log: str) -> bool:
    """True once the load ended by itself (its `done` line, which counts every outcome, is there)."""
    done = [r["done"] for r in _records(log) if "done" in r]
    return bool(done) and done[-1] == len(outcomes(log))


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), *sys.argv[4:5])
