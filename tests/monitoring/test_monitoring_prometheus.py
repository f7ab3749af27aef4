"""A real Prometheus (Debian's `prometheus`) scrapes a running `dsv4 serve` (the tiny model, through
its --metrics-port listener), sglang-router in front of it, and the operator's metrics; after some
traffic every dashboard query, evaluated through Prometheus' HTTP API, returns data. The targets carry
the labels the rendered PodMonitor gives them (namespace, pod, dsv4_deployment, dsv4_role).

A prefill/decode pair of `dsv4 serve` processes moves state over Mooncake beside them, so the PD
panels (transfer bandwidth and time, failures, queues) are fed by real transfers; the refused-requests
panel reads counters every server starts at 0 for each reason."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import yaml

from dsv4_operator import metrics

from .test_monitoring_dashboard import queries

NAME = "dsv4-tiny"
LABELS = {"namespace": "test", "dsv4_deployment": "demo"}
WAIT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from dsv4_engine.make_tiny import make_tiny
    from dsv4_engine.testing import one_thread

    with one_thread():
        return str(make_tiny(tmp_path_factory.mktemp("prom-ckpt") / "tiny", seed=0))


@pytest.fixture(scope="module")
def server(tiny: str) -> Iterator[tuple[str, int]]:
    """`dsv4 serve`'s app on the tiny model, in a thread: (base URL, metrics port)."""
    import uvicorn

    from dsv4_engine.llm import LLM
    from dsv4_engine.server.app import create_app
    from dsv4_engine.server.args import ServerSettings
    from dsv4_engine.testing import one_thread

    stack = contextlib.ExitStack()
    stack.enter_context(one_thread())  # spinning intra-op threads on shared cores: many times slower
    ckpt = tiny
    llm = LLM(ckpt)
    port, mport = free_port(), free_port()
    settings = ServerSettings(model=ckpt, served_model_name=NAME, metrics_port=mport)
    srv = uvicorn.Server(
        uvicorn.Config(create_app(settings, lambda: llm.engine), host="127.0.0.1", port=port,
                       log_level="warning", lifespan="on")
    )  # fmt: skip
    thread = threading.Thread(target=srv.run, name="uvicorn-prom", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        until(lambda: answers(f"{base}/health"), "/health to answer 200")
        yield base, mport
    finally:
        srv.should_exit = True
        thread.join(30)
        stack.close()


def _serve(ckpt: str, log_path: Any, *args: str) -> tuple[subprocess.Popen[bytes], str, int]:
    """`dsv4 serve` as a process: (process, base URL, metrics port)."""
    port, mport = free_port(), free_port()
    cmd = [sys.executable, "-c", "import sys; from dsv4_operator.cli import main; sys.exit(main())", "serve",
           "--model", ckpt, "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", str(mport), "--max-model-len", "1024", "--num-pages", "32", *args]  # fmt: skip
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}", mport


@pytest.fixture(scope="module")
def pd_pair(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A prefill and a decode `dsv4 serve` (bootstrap on `bootstrap_port`), ready."""
    tmp = tmp_path_factory.mktemp("prom-pd")
    bootstrap = free_port()
    procs = {
        role: _serve(
            tiny, tmp / f"{role}.log", "--disaggregation-mode", role, "--bootstrap-port", str(bootstrap)
        )
        for role in ("prefill", "decode")
    }

    def ready(role: str) -> bool:
        proc, base, _ = procs[role]
        assert proc.poll() is None, (tmp / f"{role}.log").read_text()[-4000:]
        return answers(f"{base}/health")

    try:
        for role in procs:
            until(lambda role=role: ready(role), f"the {role} server to be ready")
        yield {"bootstrap_port": bootstrap, **procs}
    finally:
        for proc, _, _ in procs.values():
            proc.terminate()
        for proc, _, _ in procs.values():
            proc.wait(60)


@pytest.fixture(scope="module")
def router(server: tuple[str, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    base, _ = server
    port, mport = free_port(), free_port()
    log_path = tmp_path_factory.mktemp("prom-router") / "router.log"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", base, "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport),
           "--policy", "round_robin"]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"

    def registered() -> bool:
        assert proc.poll() is None, log_path.read_text()[-4000:]
        try:
            return NAME in httpx.get(f"{url}/v1/models", timeout=2).text
        except httpx.HTTPError:
            return False

    try:
        until(registered, "sglang-router to register the server")
        yield url, mport
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def operator_metrics() -> Iterator[int]:
    """The operator's registry on a port, holding what a reconcile loop records."""
    from prometheus_client import start_http_server

    port = free_port()
    httpd, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.REGISTRY)
    with metrics.timed_reconcile():
        metrics.count_write("patch", "StatefulSet")
    with contextlib.suppress(RuntimeError), metrics.timed_reconcile():
        raise RuntimeError("a failed reconcile")
    conditions = [{"type": "Ready", "status": "True"}, {"type": "Degraded", "status": "False"}]
    metrics.record_resource("test", "demo", conditions, replicas={"decode": 1}, ready={"decode": 1})
    try:
        yield port
    finally:
        metrics.forget_resource("test", "demo")
        httpd.shutdown()
        thread.join(10)


@pytest.fixture(scope="module")
def prometheus(
    prometheus_bin: str,
    server: tuple[str, int],
    router: tuple[str, int],
    pd_pair: dict[str, Any],
    operator_metrics: int,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("prometheus")
    job = lambda name, port, **labels: {  # noqa: E731
        "job_name": name,
        "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": labels}],
    }
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            job("dsv4", server[1], **LABELS, pod="demo-0", dsv4_role="colocated"),
            job("router", router[1], **LABELS, pod="demo-router-0", dsv4_role="router"),
            job("prefill", pd_pair["prefill"][2], **LABELS, pod="demo-prefill-0", dsv4_role="prefill"),
            job("decode", pd_pair["decode"][2], **LABELS, pod="demo-decode-0", dsv4_role="decode"),
            job("operator", operator_metrics, namespace="dsv4-system", pod="dsv4-operator-0"),
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = tmp / "prometheus.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [prometheus_bin, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log_path.read_text()[-4000:]
        return answers(f"{url}/-/ready")

    try:
        until(ready, "Prometheus to be ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    got = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert got["status"] == "success", (expr, got)
    return got["data"]["result"]


def concrete(expr: str) -> str:
    """A dashboard query as Grafana sends it: its variables filled in."""
    return expr.replace("$__rate_interval", "15s").replace("$namespace", ".*").replace("$deployment", ".*")


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    prometheus: str, server: tuple[str, int], router: tuple[str, int], pd_pair: dict[str, Any]
) -> None:
    def targets_up() -> bool:
        active = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return len(active) == 5 and all(t["health"] == "up" for t in active)

    until(targets_up, "every target to be scraped")
    body = {"model": NAME, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
    sent = 0

    def request(base: str) -> None:
        nonlocal sent
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        sent += 1

    def pd_request() -> None:  # the router's dispatch: the same body, bootstrap fields, to both servers
        import random

        pd_body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": pd_pair["bootstrap_port"],
                   "bootstrap_room": random.randrange(2**63)}  # fmt: skip
        with cf.ThreadPoolExecutor(2) as ex:
            legs = [ex.submit(httpx.post, f"{pd_pair[r][1]}/v1/completions", json=pd_body, timeout=120)
                    for r in ("prefill", "decode")]  # fmt: skip
            for leg in legs:
                assert leg.result().status_code == 200, leg.result().text

    for base in (server[0], router[0]):
        request(base)
    pd_request()
    want = {(title, concrete(e)) for title, e in queries()}
    assert len(want) >= 20
    empty: set[tuple[str, str]] = set(want)

    def has_data(expr: str) -> bool:  # a series with a number (a quantile of nothing is NaN)
        return any(r["value"][1] not in ("NaN", "+Inf", "-Inf") for r in query(prometheus, expr))

    def all_have_data() -> bool:
        for item in list(empty):
            if has_data(item[1]):
                empty.discard(item)
        if empty and sent < 40:  # keep the rate windows fed until Prometheus has scraped them twice
            request(server[0])
            pd_request()
            with metrics.timed_reconcile():
                pass
        return not empty

    with contextlib.suppress(AssertionError):
        until(all_have_data, "every dashboard query to return data", timeout=90)
    assert not empty, sorted(empty)
    (ok,) = query(prometheus, 'sum(vllm:request_success_total{job="dsv4", model_name="dsv4-tiny"})')
    assert float(ok["value"][1]) >= 2
    assert query(prometheus, 'count({job="router"}) > 1')  # the router's own series are scraped too
    kv = query(prometheus, 'vllm:kv_cache_usage_perc{dsv4_deployment="demo", pod="demo-0"}')
    assert kv and 0 <= float(kv[0]["value"][1]) <= 1
    assert json.dumps(query(prometheus, 'dsv4_operator_resource_condition{type="Ready"}')).count('"1"') == 1
