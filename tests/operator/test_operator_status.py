"""Status and conditions from live objects: reasons name what is really wrong."""

from __future__ import annotations

from dsv4_operator import status as st
from dsv4_operator.reconcile import choose_serving


def workload(kind: str, role: str, fp: str, replicas: int, ready: int) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": kind,
        "metadata": {"name": f"demo-{role}-{fp}", "labels": {"dsv4.ai/role": role, "dsv4.ai/fingerprint": fp}},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"dsv4.ai/role": role, "dsv4.ai/fingerprint": fp}}},
        "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas},
    }  # fmt: skip


def generation(fp: str, ready: bool) -> list[dict]:
    return [
        workload("StatefulSet", "prefill", fp, 2, 2 if ready else 0),
        workload("StatefulSet", "decode", fp, 1, 1 if ready else 0),
        workload("Deployment", "router", fp, 1, 1 if ready else 0),
    ]


def pod(name: str, fp: str, *, unschedulable: str = "", waiting: str = "") -> dict:
    status: dict = {"conditions": [], "containerStatuses": []}
    if unschedulable:
        status["conditions"].append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        )
    if waiting:
        status["containerStatuses"].append({"name": "engine", "state": {"waiting": {"reason": waiting}}})
    return {"metadata": {"name": name, "labels": {"dsv4.ai/fingerprint": fp}}, "status": status}


def by_type(conds: list[dict]) -> dict[str, dict]:
    return {c["type"]: c for c in conds}


def test_ready_generation_is_ready_and_complete() -> None:
    c = by_type(st.conditions(generation("a", True), [], current="a", serving="a"))
    assert (c["Ready"]["status"], c["Progressing"]["status"], c["Degraded"]["status"]) == (
        "True",
        "False",
        "False",
    )
    assert c["Progressing"]["reason"] == "Complete"


def test_waiting_names_the_roles_short_of_replicas() -> None:
    c = by_type(st.conditions(generation("a", False), [], current="a", serving="a"))
    assert c["Ready"]["status"] == "False"
    assert "prefill 0/2" in c["Ready"]["message"] and "decode 0/1" in c["Ready"]["message"]


def test_shortage_during_rollout_keeps_old_generation_serving() -> None:
    objs = generation("old", True) + generation("new", False)
    pods = [
        pod(
            "demo-prefill-new-0",
            "new",
            unschedulable="0/4 nodes are available: 4 Insufficient huawei.com/Ascend910.",
        )
    ]
    c = by_type(st.conditions(objs, pods, current="new", serving="old"))
    assert c["Ready"]["status"] == "True"  # the old generation still serves
    assert c["Progressing"]["reason"] == "InsufficientCapacity"
    assert "Insufficient huawei.com/Ascend910" in c["Progressing"]["message"]
    assert "old keeps serving" in c["Progressing"]["message"]


def test_crash_loop_and_image_pull_degrade() -> None:
    pods = [
        pod("demo-decode-a-0", "a", waiting="CrashLoopBackOff"),
        pod("demo-prefill-a-0", "a", waiting="ImagePullBackOff"),
    ]
    c = by_type(st.conditions(generation("a", False), pods, current="a", serving="a"))
    assert c["Degraded"]["status"] == "True"
    assert c["Degraded"]["reason"] == "CrashLoopBackOff"
    assert "demo-decode-a-0" in c["Degraded"]["message"] and "1 more" in c["Degraded"]["message"]


def test_apply_rejection_is_the_degraded_reason() -> None:
    err = st.Problem("ApplyRejected", "StatefulSet/x: admission webhook denied")
    c = by_type(st.conditions(generation("a", True), [], current="a", serving="a", error=err))
    assert (c["Degraded"]["reason"], c["Degraded"]["message"]) == ("ApplyRejected", err.message)


def test_build_is_stable_so_a_resync_writes_nothing() -> None:
    objs = generation("a", True)
    svc = {"metadata": {"name": "demo", "namespace": "ns"}, "spec": {"ports": [{"port": 8000}]}}
    first = st.build(
        generation=3, objs=objs, pods=[], current="a", serving="a", service=svc, old=None, now="t1"
    )
    again = st.build(
        generation=3, objs=objs, pods=[], current="a", serving="a", service=svc, old=first, now="t2"
    )
    assert not st.differs(again, first)
    assert first["endpoint"] == "http://demo.ns.svc:8000"
    assert first["decode"] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                               "selector": "dsv4.ai/fingerprint=a,dsv4.ai/role=decode"}  # fmt: skip
    assert first["observedGeneration"] == 3


def test_removed_role_is_removed_from_status() -> None:
    old = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "router": {"replicas": 1}}
    new = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    assert st.differs(new, old)
    assert st.patch(new, old)["router"] is None


def test_endpoint_moves_only_when_the_new_generation_is_ready() -> None:
    svc = {"spec": {"selector": {"dsv4.ai/fingerprint": "old"}}}
    assert choose_serving(generation("old", True) + generation("new", False), svc, "new") == "old"
    assert choose_serving(generation("old", True) + generation("new", True), svc, "new") == "new"
    assert choose_serving(generation("new", False), svc, "new") == "new"  # nothing left to serve the old
    assert choose_serving([], None, "new") == "new"  # first creation
