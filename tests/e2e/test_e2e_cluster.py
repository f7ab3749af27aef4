"""The tier-5 scenarios on a real cluster (see conftest.py for what selects it): the endpoint
serves a streamed chat equal to the non-streamed greedy reply; a killed decode pod is recreated
and pairs again with no request hanging; decode scales to 2 and back under load with no failed
request; a new model revision rolls out under an in-cluster load with no failed request and no
cross-generation pair; a first-revision prefill paired by hand with the new decode is refused by
the layout fingerprint; deleting the resource garbage-collects every child. In order, on one
deployment."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from e2ekube import Client, InClusterLoad, Kube, port_forward, wait_until
from serving import (
    CHAT,
    GREEDY,
    Load,
    assert_pair_refused,
    client,
    is_ready,
    pair_request,
    port_of,
    stray_prefill,
    streamed_chat,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]
L_FINGERPRINT = "dsv4.ai/fingerprint"
# Every kind of child the operator creates (the generation-scoped ones carry the fingerprint label).
CHILDREN = "pods,statefulsets,deployments,services,configmaps,serviceaccounts,roles,rolebindings,pdb"


def _pods(kube: Kube, name: str, role: str) -> list[dict[str, Any]]:
    return kube.get("pods", "-n", kube.ns, "-l", f"dsv4.ai/deployment={name},dsv4.ai/role={role}")["items"]


def test_e2e_the_endpoint_serves_a_streamed_chat(deployment: dict[str, Any], endpoint: str) -> None:
    model = deployment["model"]
    reply = client(endpoint).chat.completions.create(model=model, messages=CHAT, **GREEDY)
    assert reply.choices[0].finish_reason == "length"
    assert streamed_chat(endpoint, model) == reply.choices[0].message.content


def test_e2e_a_killed_decode_pod_is_recreated_and_pairs_again(
    kube: Kube, deployment: dict[str, Any], endpoint: str
) -> None:
    name = deployment["name"]
    old = _pods(kube, name, "decode")[0]
    with Client().pool(2) as pool:
        flying = [pool.submit(streamed_chat, endpoint, deployment["model"], max_tokens=512) for _ in range(2)]
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
    wait_until(
        lambda: streamed_chat(endpoint, deployment["model"]), 600, "a reply through the recreated decode pod"
    )


def test_e2e_scaling_decode_under_load_fails_no_request(
    kube: Kube, deployment: dict[str, Any], endpoint: str
) -> None:
    name = deployment["name"]
    with Load(Client(), endpoint, workers=2, model=deployment["model"]) as load:
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


def _chat_body(model: str) -> dict[str, Any]:
    """The load's request as JSON: what `serving.streamed_chat` sends, its extra_body inlined."""
    extra = GREEDY.get("extra_body", {})
    return (
        {"model": model, "messages": CHAT, "stream": True}
        | {k: v for k, v in GREEDY.items() if k != "extra_body"}
        | extra
    )


def test_e2e_a_new_model_revision_rolls_out_under_load_and_never_mixes_generations(
    kube: Kube, deployment: dict[str, Any]
) -> None:
    """A fingerprint change (DSV4_E2E_ROLLOUT_PATCH; for the CPU example the image's tiny-v2, other
    weights) under a load sent from inside the cluster to the endpoint Service's DNS name: the new
    generation starts beside the old, the endpoint moves when it is Ready, the old one drains and
    goes, no request fails, and every reply is one revision's own (greedy, so one text per
    revision; a prefill of one generation paired with a decode of the other would answer with
    neither)."""
    name = deployment["name"]
    mine = f"dsv4.ai/deployment={name}"
    generation = lambda: kube.get("service", name, "-n", kube.ns)["spec"]["selector"][L_FINGERPRINT]  # noqa: E731
    of = lambda fp: kube.get(CHILDREN, "-n", kube.ns, "-l", f"{mine},{L_FINGERPRINT}={fp}")["items"]  # noqa: E731
    old = generation()
    together: list[set[str]] = []  # the generations whose pods were up at once, poll by poll

    def moved() -> str | None:
        fp = generation()  # before the pods: listed after a move, the new ones must all be Ready
        pods = kube.get("pods", "-n", kube.ns, "-l", mine)["items"]
        together.append({p["metadata"]["labels"].get(L_FINGERPRINT, "") for p in pods})
        if fp == old:
            return None
        up = {
            p["metadata"]["labels"]["dsv4.ai/role"]
            for p in pods
            if p["metadata"]["labels"].get(L_FINGERPRINT) == fp and is_ready(p)
        }
        assert up == {"prefill", "decode", "router"}, f"the endpoint moved to {fp} with only {up} Ready"
        return fp

    with InClusterLoad(kube, f"{deployment['endpoint']}/v1", _chat_body(deployment["model"])) as load:
        wait_until(lambda: load.count() >= 2, 600, "the in-cluster load to run")
        before = load.count()  # all served by the old generation: nothing else exists yet
        kube.kubectl("patch", "dsv4", name, "-n", kube.ns, "--type=merge", "-p", kube.cfg["rollout"])
        new = wait_until(moved, float(kube.cfg["ready"]), "the endpoint to move to the new generation")
        wait_until(lambda: not of(old), 900, "the old generation to drain and every object of it to go")
        after = load.count()  # from here on only the new generation exists
        wait_until(lambda: load.count() >= after + 2, 600, "the load to go on on the new generation")
    assert any({old, new} <= fps for fps in together), together  # the new one started beside the old
    assert not load.failures(), load.failures()[:5]
    texts = [text for _, text in load.results]
    first, last = set(texts[:before]), set(texts[after:])
    assert len(first) == 1 and len(last) == 1 and first != last, (first, last)
    assert set(texts) <= first | last, set(texts) - first - last  # never a cross-generation pair
    status = lambda: kube.get("dsv4", name, "-n", kube.ns).get("status") or {}  # noqa: E731
    wait_until(
        lambda: status().get("servingFingerprint") == new, 120, "the status to name the new generation"
    )
    assert all(p["metadata"]["labels"][L_FINGERPRINT] == new for p in _pods(kube, name, "decode"))


def test_e2e_the_layout_fingerprint_alone_refuses_a_cross_generation_pair(
    kube: Kube, deployment: dict[str, Any]
) -> None:
    """After the rollout: a prefill pod of the first revision that no router selects, paired by
    hand with the new generation's decode (each port-forwarded here, sent the body sglang-router
    would send), is refused by the PD handshake's layout fingerprint, naming `checkpoint`."""
    name = deployment["name"]
    decode = _pods(kube, name, "decode")[0]
    first = deployment["servingFingerprint"]  # the generation the example came up as
    assert decode["metadata"]["labels"][L_FINGERPRINT] != first, "runs after the rollout scenario"
    kube.kubectl("apply", "-f", "-", input=json.dumps(stray_prefill(deployment["doc"], kube.ns)))
    try:
        stray = wait_until(
            lambda: next((p for p in kube.get("pods", "-n", kube.ns, "-l", "app=stray")["items"] if is_ready(p)), None),
            float(kube.cfg["ready"]), "the stray first-revision prefill pod to be Ready",
        )  # fmt: skip
        body = pair_request(deployment["model"], stray, random.randrange(2**63))
        with (
            port_forward(kube, f"pod/{stray['metadata']['name']}", port_of(stray)) as p_url,
            port_forward(kube, f"pod/{decode['metadata']['name']}", port_of(decode)) as d_url,
            Client().pool(2) as pool,
        ):
            assert_pair_refused(pool, body, p_url, d_url)
    finally:
        kube.kubectl(
            "delete", "pod", "stray-prefill", "-n", kube.ns, "--ignore-not-found", "--grace-period=5"
        )


def test_e2e_deleting_the_resource_removes_every_child(kube: Kube, deployment: dict[str, Any]) -> None:
    name = deployment["name"]
    kube.kubectl("delete", "dsv4", name, "-n", kube.ns)
    wait_until(
        lambda: not kube.get(CHILDREN, "-n", kube.ns, "-l", f"dsv4.ai/deployment={name}")["items"], 900,
        "every child to be garbage-collected",
    )  # fmt: skip
