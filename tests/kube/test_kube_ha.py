"""Active/standby through a Lease: two operators, one reconciles; when it stops, the other takes over."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(180)]

ROOT = pathlib.Path(__file__).parents[2]


def holder(cluster: Any) -> str | None:
    got = cluster.kubectl("get", "lease", "dsv4-operator", "-n", "dsv4-system", "-o", "json", check=False)
    if got.returncode != 0:
        return None
    return yaml.safe_load(got.stdout)["spec"].get("holderIdentity")


def test_only_the_lease_holder_reconciles_and_a_standby_takes_over(cluster: Any, start_operator: Any) -> None:
    procs: list[subprocess.Popen] = []
    # No webhook here: drop a registration another module's operator left behind (it persists).
    cluster.kubectl("delete", "validatingwebhookconfiguration", "validate.dsv4.ai", "--ignore-not-found")
    try:
        flags = ("--leader-elect", "--lease-seconds=4", "--no-webhook")
        ops = {i: start_operator(cluster, procs, *flags, f"--identity={i}") for i in ("op-a", "op-b")}
        leader = cluster.wait(lambda: holder(cluster), 30, "a lease holder")
        standby = next(i for i in ops if i != leader)

        cluster.kubectl("create", "namespace", "ha")
        body = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
        body["metadata"].update(namespace="ha", name="ha")
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
        sts = lambda: cluster.get("statefulsets", "-n", "ha")["items"]  # noqa: E731
        cluster.wait(lambda: len(sts()) == 2, 30, "children from the leader")
        cluster.wait(lambda: ops[leader].reconciles() > 0, 30, "the leader's first reconcile to finish")
        assert ops[standby].reconciles() == 0

        os.killpg(ops[leader].proc.pid, signal.SIGTERM)  # a clean stop releases the Lease at once
        ops[leader].proc.wait(timeout=30)
        cluster.wait(lambda: holder(cluster) == standby, 20, "the standby to take the lease")
        name = sts()[0]["metadata"]["name"]
        cluster.kubectl("delete", "statefulset", name, "-n", "ha")
        cluster.wait(
            lambda: name in {s["metadata"]["name"] for s in sts()}, 30, "the new leader to restore it"
        )
        assert ops[standby].reconciles() > 0
        assert holder(cluster) == standby
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
