"""The tier-5 scenarios on a real cluster (see conftest.py for what selects it): the endpoint
serves a streamed chat equal to the non-streamed greedy reply; a killed decode pod is recreated
and pairs again with no request hanging; decode scales to 2 and back under load with no failed
request; deleting the resource garbage-collects every child."""

from __future__ import annotations

from typing import Any

import pytest
from e2ekube import Client, Kube, wait_until
from serving import CHAT, GREEDY, MODEL, Load, client, is_ready, streamed_chat

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]


def _pods(kube: Kube, name: str, role: str) -> list[dict[str, Any]]:
    return kube.get("pods", "-n", kube.ns, "-l", f"dsv4.ai/deployment={name},dsv4.ai/role={role}")["items"]


def test_e2e_the_endpoint_serves_a_streamed_chat(deployment: dict[str, Any], endpoint: str) -> None:
    reply = client(endpoint).chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    assert reply.choices[0].finish_reason == "length"
    assert streamed_chat(endpoint) == reply.choices[0].message.content


def test_e2e_a_killed_decode_pod_is_recreated_and_pairs_again(
    kube: Kube, deployment: dict[str, Any], endpoint: str
) -> None:
    name = deployment["name"]
    old = _pods(kube, name, "decode")[0]
    with Client().pool(2) as pool:
        flying = [pool.submit(streamed_chat, endpoint, max_tokens=512) for _ in range(2)]
        kube.kubectl("delete", "pod", old["metadata"]["name"], "-n", kube.ns, "--grace-period=0", "--force")
        for f in flying:  # none hangs: each completes or errors
            try:
                f.result(timeout=300)
            except Exception as exc:
                assert "Timeout" not in type(exc).__name__, exc
    wait_until(
        lambda: any(is_ready(p) and p["metadata"]["uid"] != old["metadata"]["uid"] for p in _pods(kube, name, "decode")),
        1800, "the recreated decode pod to be Ready",
    )  # fmt: skip
    wait_until(lambda: streamed_chat(endpoint), 600, "a reply through the recreated decode pod")


def test_e2e_scaling_decode_under_load_fails_no_request(
    kube: Kube, deployment: dict[str, Any], endpoint: str
) -> None:
    name = deployment["name"]
    with Load(Client(), endpoint, workers=2) as load:
        wait_until(lambda: load.count() >= 2, 600, "the load to run")
        kube.kubectl("scale", "dsv4", name, "-n", kube.ns, "--replicas=2")
        wait_until(
            lambda: len([p for p in _pods(kube, name, "decode") if is_ready(p)]) == 2, 1800, "2 decode pods"
        )
        kube.kubectl("scale", "dsv4", name, "-n", kube.ns, "--replicas=1")
        wait_until(lambda: len(_pods(kube, name, "decode")) == 1, 900, "the scale-down to drain")
        after = load.count()
        wait_until(lambda: load.count() >= after + 2, 600, "the load to go on")
    assert not load.failures(), load.failures()[:5]


def test_e2e_deleting_the_resource_removes_every_child(kube: Kube, deployment: dict[str, Any]) -> None:
    name = deployment["name"]
    kube.kubectl("delete", "dsv4", name, "-n", kube.ns)
    kinds = "pods,statefulsets,deployments,services,configmaps,serviceaccounts,roles,rolebindings,pdb"
    wait_until(
        lambda: not kube.get(kinds, "-n", kube.ns, "-l", f"dsv4.ai/deployment={name}")["items"], 900,
        "every child to be garbage-collected",
    )  # fmt: skip
