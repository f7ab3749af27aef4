"""Operator benchmark on the real tier (kube-apiserver + kube-controller-manager v1.20.2, etcd):

- create -> all children applied: for N Dsv4Deployments created back to back, the time from each
  create until every object `dsv4 render` lists for it exists (p50, p99, max);
- writes per no-op resync: the operator's write requests in the API server's audit log, divided by its
  reconciles, once everything has settled;
- the operator's memory (RSS) with N resources.

Needs the binaries of scripts/build-kube.sh. Usage: python bench/operator.py [--n 100] [--resync 10]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import kopf
import psutil
import yaml

from dsv4_operator import manifests, spec
from dsv4_operator.apply import CHILD_KINDS
from dsv4_operator.kube import Api

ROOT = pathlib.Path(__file__).resolve().parents[1]
NS = "bench"


def kube_env() -> Any:
    """The real tier's cluster helpers (tests/kube/conftest.py), loaded by path."""
    loaded = importlib.util.spec_from_file_location("dsv4_kube_env", ROOT / "tests" / "kube" / "conftest.py")
    module = importlib.util.module_from_spec(loaded)  # type: ignore[arg-type]
    sys.modules[loaded.name] = module  # type: ignore[union-attr]  # dataclasses look their module up
    loaded.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def body(i: int) -> dict:
    obj = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    obj["metadata"] = {"name": f"b{i:03d}", "namespace": NS}
    return obj


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure_creates(api: Api, n: int) -> list[float]:
    want = {f"b{i:03d}": {(o["kind"], o["metadata"]["name"]) for o in manifests.render(spec.parse(body(i)))}
            for i in range(n)}  # fmt: skip
    started: dict[str, float] = {}
    done: dict[str, float] = {}
    for i in range(n):
        obj = body(i)
        started[obj["metadata"]["name"]] = time.monotonic()
        await api.create(obj)
    deadline = time.monotonic() + 600
    while len(done) < n and time.monotonic() < deadline:
        lists = await asyncio.gather(
            *(api.list(v, k, NS, {"app.kubernetes.io/name": "dsv4"}) for v, k in CHILD_KINDS),
            api.list("policy/v1beta1", "PodDisruptionBudget", NS, {"app.kubernetes.io/name": "dsv4"}),
        )
        now = time.monotonic()
        have: dict[str, set[tuple[str, str]]] = {}
        for obj in (o for group in lists for o in group):
            owner = obj["metadata"]["labels"].get("dsv4.ai/deployment", "")
            have.setdefault(owner, set()).add((obj["kind"], obj["metadata"]["name"]))
        for name, keys in want.items():
            if name not in done and keys <= have.get(name, set()):
                done[name] = now
        await asyncio.sleep(0.2)
    if len(done) < n:
        raise SystemExit(f"only {len(done)}/{n} resources got all their children within 10 minutes")
    return [done[k] - started[k] for k in done]


def settle(cluster: Any, seconds: float = 3.0, limit: float = 120.0) -> None:
    """Wait until the operator has written nothing for `seconds`."""
    deadline = time.monotonic() + limit
    offset = cluster.audit_offset()
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if cluster.writes_since(offset):
            offset, quiet_since = cluster.audit_offset(), time.monotonic()
        elif time.monotonic() - quiet_since >= seconds:
            return


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--resync", type=float, default=10.0)
    p.add_argument("--keep-log", type=pathlib.Path, help="copy the operator's log here")
    args = p.parse_args(argv)
    env = kube_env()
    procs: list[subprocess.Popen] = []
    with (
        tempfile.TemporaryDirectory(prefix="dsv4-bench-") as tmp,
        env.run_cluster(pathlib.Path(tmp)) as cluster,
    ):
        try:
            cluster.kubectl("create", "namespace", NS)
            op = env.start_operator(cluster, procs, f"--resync-seconds={args.resync}")
            api = Api()
            api.use(kopf.ConnectionInfo(server=cluster.server, token=env.ADMIN_TOKEN, insecure=True))
            proc = psutil.Process(op.proc.pid)
            cpu0, wall0 = sum(proc.cpu_times()[:2]), time.monotonic()
            latencies = asyncio.run(_run(api, args.n))
            busy = (sum(proc.cpu_times()[:2]) - cpu0) / (time.monotonic() - wall0)
            settle(cluster)
            offset, before = cluster.audit_offset(), op.reconciles()
            cluster.wait(
                lambda: op.reconciles() >= before + 2 * args.n, 10 * args.resync + 120, "two resyncs"
            )
            reconciles = op.reconciles() - before
            writes = cluster.writes_since(offset)
            rss = psutil.Process(op.proc.pid).memory_info().rss / 2**20
            count = op.metric("dsv4_operator_reconcile_duration_seconds_count")
            mean_ms = 1000 * op.metric("dsv4_operator_reconcile_duration_seconds_sum") / max(count, 1)
        finally:
            env._stop(procs)
            for log in sorted(pathlib.Path(tmp).glob("operator-*.log"))[:1] if args.keep_log else []:
                shutil.copy(log, args.keep_log)
    rows = [
        ("resources", f"{args.n}"),
        ("create -> all children applied, p50", f"{statistics.median(latencies):.2f} s"),
        ("create -> all children applied, p99", f"{pct(latencies, 0.99):.2f} s"),
        ("create -> all children applied, max", f"{max(latencies):.2f} s"),
        ("operator CPU while creating (cores)", f"{busy:.2f}"),
        ("no-op resync: reconciles observed", f"{reconciles:.0f}"),
        ("no-op resync: write requests", f"{len(writes)}"),
        ("writes per no-op resync", f"{len(writes) / max(reconciles, 1):.3f}"),
        ("reconcile duration, mean", f"{mean_ms:.1f} ms"),
        (f"operator RSS with {args.n} resources", f"{rss:.0f} MiB"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"\ndsv4 operator on kube-apiserver v1.20.2 (resync {args.resync:g} s)")
    print("-" * (width + 14))
    for k, v in rows:
        print(f"{k.ljust(width)}  {v:>10}")
    if writes:
        print("writes seen:", ", ".join(sorted(set(writes))[:10]))
    return 0


async def _run(api: Api, n: int) -> list[float]:
    try:
        return await measure_creates(api, n)
    finally:
        await api.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
