"""Desired-versus-live decisions: what is applied, what is left alone, what is deleted."""

from __future__ import annotations

import copy

from dsv4_operator import apply as ap


def sts(name: str = "demo-prefill-abc", fp: str = "abc", replicas: int = 1) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"dsv4.ai/deployment": "demo", "dsv4.ai/fingerprint": fp}},
        "spec": {"replicas": replicas, "template": {"spec": {"containers": [
            {"name": "engine", "image": "img:1", "resources": {"limits": {"cpu": "1000m"}}, "ports": [{"containerPort": 8000}]}
        ], "hostNetwork": False}}},
    }  # fmt: skip


def live_of(want: dict) -> dict:
    """What an API server returns: the applied fields, normalised, plus defaults and bookkeeping."""
    live = copy.deepcopy(want)
    live["metadata"].update(uid="u1", resourceVersion="7", managedFields=[{"manager": "dsv4-operator"}])
    pod = live["spec"]["template"]["spec"]
    pod.pop("hostNetwork")  # false is omitted
    pod["restartPolicy"] = "Always"
    c = pod["containers"][0]
    c["resources"]["limits"]["cpu"] = "1"  # quantities come back canonical
    c["ports"][0]["protocol"] = "TCP"
    c["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"replicas": 1}
    return live


def test_unchanged_object_is_not_applied_again() -> None:
    want = ap.stamp(sts())
    assert not ap.needs_apply(want, live_of(want))


def test_absent_object_is_applied() -> None:
    assert ap.needs_apply(ap.stamp(sts()), None)


def test_hand_edit_is_restored() -> None:
    want = ap.stamp(sts())
    live = live_of(want)
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "img:hacked"
    assert ap.needs_apply(want, live)
    live = live_of(want)
    live["spec"]["replicas"] = 5
    assert ap.needs_apply(want, live)


def test_removed_field_is_seen_through_the_hash() -> None:
    # A field dropped from the rendering is still "covered" by live; only the hash notices.
    old = ap.stamp(sts())
    new = sts()
    del new["spec"]["template"]["spec"]["containers"][0]["resources"]
    live = live_of(old)
    assert ap.covers(live, new)
    assert ap.needs_apply(ap.stamp(new), live)


def test_hash_ignores_its_own_annotation() -> None:
    a = ap.stamp(sts())
    assert ap.content_hash(a) == ap.content_hash(sts())
    assert ap.content_hash(sts(replicas=2)) != ap.content_hash(sts())


def test_stale_keeps_plan_and_serving_generation() -> None:
    owner = {"ownerReferences": [{"uid": "owner"}]}

    def owned(o: dict) -> dict:
        o["metadata"].update(owner)
        return o

    in_plan = owned(sts("demo-prefill-new", "new"))
    old_gen = owned(sts("demo-prefill-old", "old"))
    retired = owned(sts("demo-prefill-gone", "gone"))
    foreign = sts("other-prefill-x", "gone")  # not ours: same labels, another owner
    live = [in_plan, old_gen, retired, foreign]
    desired = [sts("demo-prefill-new", "new")]
    gone = ap.stale(live, desired, keep={"old"}, uid="owner")
    assert [o["metadata"]["name"] for o in gone] == ["demo-prefill-gone"]
    gone = ap.stale(live, desired, keep=set(), uid="owner")
    assert {o["metadata"]["name"] for o in gone} == {"demo-prefill-old", "demo-prefill-gone"}
