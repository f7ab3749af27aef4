"""What the scenarios share: the example applied, pods looked up, requests sent from inside the
node namespace with the official openai client, a steady load whose every outcome is recorded."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

ROOT = pathlib.Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "cpu-tiny.yaml"
NAME, NS, MODEL = "dsv4-tiny", "default", "dsv4-tiny"
NAMESPACE, RELEASE = "dsv4-system", "dsv4"  # the operator's: the chart's namespace and release name
OPERATOR_PODS = "app.kubernetes.io/name=dsv4-operator"
EARLIER = "0.0.1"  # the operator release the chart is first installed at (conftest's `earlier_release`)
CHAT = [{"role": "user", "content": "Say hello to the cluster."}]
GREEDY: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
SERVE_FLAGS = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--page-size",
    "128",
    "--max-model-len",
    "4096",
    "--chunked-prefill-size",
    "1024",
    "--max-num-seqs",
    "16",
]  # fmt: skip  (the example's engine)


def client(base_url: str, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout)


def streamed_chat(base_url: str, model: str = MODEL, **kw: Any) -> str:
    stream = client(base_url).chat.completions.create(
        model=model, messages=CHAT, stream=True, **(GREEDY | kw)
    )
    return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)


def pods(kube: Any, role: str) -> list[dict[str, Any]]:
    sel = f"dsv4.ai/deployment={NAME},dsv4.ai/role={role}"
    return kube.get("pods", "-n", NS, "-l", sel)["items"]


def is_ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conds
    )


def port_of(pod: dict[str, Any], name: str = "http") -> int:
    ports = pod["spec"]["containers"][0]["ports"]
    return next(p["containerPort"] for p in ports if p["name"] == name)


def router_url(kube: Any, timeout: float = 300) -> str:
    """The router pod's own address: there is no Service proxy on this tier. Waited for: the router
    is Ready only while it has a worker of each role, so just after a decode restart it may not be."""
    from suite.realkube import wait_until

    def ready() -> dict[str, Any] | None:
        got = [p for p in pods(kube, "router") if is_ready(p)]
        return got[0] if len(got) == 1 else None

    router = wait_until(ready, timeout, "one Ready router pod")
    return f"http://{router['status']['podIP']}:{port_of(router)}/v1"


def counter(base: str, name: str) -> float:
    """The sum of a Prometheus counter's samples on a server's /metrics."""
    total = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] in (name, f"{name}_total"):
            total += float(value)
    return total


def stray_prefill(doc: dict[str, Any], namespace: str, name: str = "stray-prefill") -> dict[str, Any]:
    """A prefill Pod of `doc`'s generation, as the operator renders it, but labelled `app: stray`
    so that no router selects it: what a router whose selectors lacked the fingerprint could still
    pair (the guard scenario applies it after the rollout to another generation)."""
    from dsv4_operator.manifests import render
    from dsv4_operator.spec import parse

    objs = render(parse(doc), namespace=namespace)
    (sts,) = [
        o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["labels"]["dsv4.ai/role"] == "prefill"
    ]
    spec = sts["spec"]["template"]["spec"]
    # Its generation's ConfigMap went with the rollout; the server does not read it.
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "engine-config"]
    for c in spec["containers"]:
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "engine-config"]
    annotations = sts["spec"]["template"]["metadata"].get("annotations", {})
    meta = {"name": name, "namespace": namespace, "labels": {"app": "stray"}, "annotations": annotations}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def pair_request(model: str, prefill: dict[str, Any], room: int) -> dict[str, Any]:
    """The completion body sglang-router sends both servers of a pair, `prefill` (a Pod) its
    bootstrap side: the same body POSTed to a prefill and a decode server pairs them by hand."""
    return {
        "model": model,
        "prompt": "Say hello",
        "max_tokens": 4,
        "bootstrap_host": prefill["status"]["podIP"],
        "bootstrap_port": int(prefill["metadata"]["annotations"]["sglang.ai/bootstrap-port"]),
        "bootstrap_room": room,
    }


def assert_pair_refused(pool: Executor, body: dict[str, Any], prefill: str, decode: str) -> None:
    """`body` (a `pair_request`) POSTed at once to a prefill and a decode server (base URLs, reached
    from `pool`'s threads): the decode refuses the pair by the layout fingerprint, a 502 naming
    `checkpoint`, and the prefill, told so, ends with an error too."""
    post = lambda base: httpx.post(f"{base}/v1/completions", json=body, timeout=120)  # noqa: E731
    p = pool.submit(post, prefill)
    d = pool.submit(post, decode).result(180)
    p = p.result(180)
    assert d.status_code == 502 and "checkpoint" in d.json()["error"]["message"], d.text
    assert p.status_code >= 400, p.text


@contextlib.contextmanager
def colocated(model: pathlib.Path, port: int, log: pathlib.Path) -> Iterator[str]:
    """A colocated `dsv4 serve` (no PD) of the same checkpoint and engine flags on 127.0.0.1, one
    intra-op thread as in the pods: the reference for the cluster's greedy output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    args = [sys.executable, "-m", "dsv4_operator.cli", "serve", "--model", str(model), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port), *SERVE_FLAGS]  # fmt: skip
    proc = subprocess.Popen(
        args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


class Endpoints:
    """The endpoint Service as kube-proxy would see it: a thread in this (the machine's) namespace
    keeps the first ready address of its Endpoints object (the controller-manager maintains it from
    the Service's selector and the pods' readiness); `url()` is where a request goes now."""

    def __init__(self, kube: Any) -> None:
        self.kube, self.seen, self._url = kube, [], None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._read()
        self._thread.start()

    def _read(self) -> None:
        got = self.kube.get("endpoints", NAME, "-n", NS)
        for subset in got.get("subsets") or []:
            port = next(p["port"] for p in subset["ports"] if p.get("name") == "http")
            if subset.get("addresses"):
                url = f"http://{subset['addresses'][0]['ip']}:{port}/v1"
                if url != self._url:
                    self.seen.append(url)
                self._url = url
                return

    def _watch(self) -> None:
        while not self._stop.wait(0.2):  # kube-proxy's sync period, in small
            with contextlib.suppress(Exception):  # a kubectl timeout under load: the last rules stay
                self._read()

    def url(self) -> str:
        assert self._url, "the endpoint Service has no ready address"
        return self._url

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


@dataclass
class Load:
    """`workers` threads in the node namespace, each sending one streamed chat after another to the
    router until stopped; every outcome kept (the text, or the error's type and message)."""

    node: Any
    url: str | Callable[[], str]  # a callable is asked before every request
    workers: int = 2
    model: str = MODEL  # the served model name (the e2e tier's example may have another)
    results: list[tuple[str, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Load:
        self._pool = self.node.pool(self.workers)
        self._futures: list[Future] = [self._pool.submit(self._loop) for _ in range(self.workers)]
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                url = self.url() if callable(self.url) else self.url
                self.results.append(("ok", streamed_chat(url, self.model)))
            except Exception as exc:  # recorded, judged by the test
                self.results.append((type(exc).__name__, str(exc)))

    def count(self) -> int:
        return len(self.results)

    def failures(self) -> list[tuple[str, str]]:
        return [r for r in self.results if r[0] != "ok"]

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=300)  # each loop ends after its current request: none may hang
        self._pool.shutdown()


def operator_pods(kube: Any) -> list[dict[str, Any]]:
    """The release's Ready operator pods."""
    return [p for p in kube.get("pods", "-n", NAMESPACE, "-l", OPERATOR_PODS)["items"] if is_ready(p)]


def lease_holder(kube: Any) -> str | None:
    """The operator pod holding the release's Lease (its holderIdentity is the pod's name)."""
    got = kube.kubectl("get", "lease", "-n", NAMESPACE, "-o", "json", check=False)
    leases = json.loads(got.stdout)["items"] if got.returncode == 0 else []
    return next((x["spec"].get("holderIdentity") for x in leases if x["spec"].get("holderIdentity")), None)
