"""Webhook certificate and validation, the Lease's claim rules, and the wake-up flags."""

from __future__ import annotations

import asyncio
import base64
import datetime
import pathlib

import kopf
import pytest
import yaml

from dsv4_operator import lease, spec, webhook
from dsv4_operator.wakeups import Wakeups

ROOT = pathlib.Path(__file__).parents[2]
NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def test_certificate_covers_its_names_and_nothing_else() -> None:
    cert, key = webhook.make_certificate(["dsv4-operator-webhook.ops.svc", "127.0.0.1"])
    assert b"BEGIN CERTIFICATE" in cert and b"PRIVATE KEY" in key
    assert webhook.covers_hosts(cert, ["dsv4-operator-webhook.ops.svc", "127.0.0.1"])
    assert not webhook.covers_hosts(cert, ["dsv4-operator-webhook.other.svc"])


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "invalid").glob("*.yaml")), ids=lambda p: p.stem)
def test_webhook_rejects_each_invalid_example_naming_the_field(path: pathlib.Path) -> None:
    field = next(
        ln.split(":", 1)[1].strip() for ln in path.read_text().splitlines() if ln.startswith("# breaks:")
    )
    with pytest.raises(kopf.AdmissionError) as err:
        webhook.validate(yaml.safe_load(path.read_text()), spec.parse)
    assert field.split(".")[-1].split("[")[0] in str(err.value)
    assert err.value.code == 422


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_webhook_admits_each_example(path: pathlib.Path) -> None:
    webhook.validate(yaml.safe_load(path.read_text()), spec.parse)


def _spec(holder: str | None, renewed_seconds_ago: float, duration: int = 15) -> dict:
    renew = NOW - datetime.timedelta(seconds=renewed_seconds_ago)
    return {"holderIdentity": holder, "renewTime": lease._fmt(renew), "leaseDurationSeconds": duration}


def test_lease_is_claimable_when_unheld_ours_or_expired() -> None:
    assert lease.claimable({}, "me", NOW)
    assert lease.claimable(_spec("me", 1), "me", NOW)
    assert lease.claimable(_spec("other", 16), "me", NOW)
    assert not lease.claimable(_spec("other", 5), "me", NOW)


def test_claim_counts_transitions_only_on_change_of_holder() -> None:
    taken = lease.claim({"spec": _spec("other", 30)}, "me", 15, NOW)["spec"]
    assert (taken["holderIdentity"], taken["leaseTransitions"]) == ("me", 1)
    renewed = lease.claim({"spec": taken}, "me", 15, NOW)["spec"]
    assert renewed["leaseTransitions"] == 1 and renewed["renewTime"] == lease._fmt(NOW)


async def test_wakeups_coalesce_and_time_out() -> None:
    w = Wakeups()
    w.poke("ns", "a")
    w.poke("ns", "a")
    assert await w.wait("ns", "a", timeout=1)
    assert not await w.wait("ns", "a", timeout=0.01)  # both pokes were consumed by one wait
    waiter = asyncio.create_task(w.wait("ns", "b", timeout=5))
    await asyncio.sleep(0)
    w.poke_all()
    assert await waiter
    assert w.rounds[("ns", "a")] == 2


async def test_in_cluster_webhook_registers_its_service(tmp_path: pathlib.Path) -> None:
    cert, key = webhook.make_certificate(["dsv4-operator-webhook.ops.svc"])
    told: list[dict] = []

    async def on_config(config: dict) -> None:
        told.append(config)

    srv = webhook.server(cert, key, addr="127.0.0.1", port=0, host="ignored",
                         service=("ops", "dsv4-operator-webhook"), on_config=on_config)  # fmt: skip
    assert srv.directory is not None and (srv.directory / "tls.key").stat().st_mode & 0o077 == 0
    folder = srv.directory
    async with srv:  # as kopf runs it: leaving closes the server's generators
        config = await anext(srv(lambda **_: None))
        assert (folder / "tls.key").exists()  # kopf re-reads it while it serves
    assert not folder.exists()  # serving ended: no key left behind
    assert config["service"] == {"namespace": "ops", "name": "dsv4-operator-webhook", "port": 0}
    assert base64.b64decode(config["caBundle"]) == cert
    assert told == [config]  # registered before kopf hears of it


CLIENT_CONFIGS = {
    "url": {"url": "https://127.0.0.1:9443", "caBundle": "Q0E="},
    "service": {
        "service": {"namespace": "ops", "name": "dsv4-operator-webhook", "port": 9443},
        "caBundle": "Q0E=",
    },
}


@pytest.mark.parametrize("how", sorted(CLIENT_CONFIGS))
def test_webhooks_are_kopfs_own_registration(how: str) -> None:
    """What the operator registers for a cluster-wide release is what kopf's managed mode would have
    written for the same handlers (a kopf upgrade that changes its conventions fails here)."""
    from kopf._cogs.structs import references
    from kopf._core.engines import admission

    from dsv4_operator import handlers

    registered = list(kopf.get_default_registry()._webhooks.get_all_handlers())
    assert sorted(h.id for h in registered) == sorted(h.id for h in handlers.HOOKS)
    for ours in handlers.HOOKS:
        (theirs,) = [h for h in registered if h.id == ours.id]
        assert (tuple(theirs.operations or ()), theirs.persistent) == (ours.operations, True)
    resource = references.Resource(handlers.GROUP, handlers.VERSION, handlers.PLURAL, kind="Dsv4Deployment",
                                   namespaced=True)  # fmt: skip
    name, cc = "validate.dsv4.ai", CLIENT_CONFIGS[how]
    kopfs = admission.build_webhooks(registered, resources=[resource], name_suffix=name, client_config=cc)
    kopfs = [{k: v for k, v in hook.items() if v is not None} for hook in kopfs]  # objectSelector: None
    assert webhook.webhooks(handlers.HOOKS, name, cc) == kopfs
    assert all("namespaceSelector" not in hook for hook in kopfs)


def test_a_namespaced_release_registers_for_its_namespaces_only() -> None:
    from dsv4_operator import handlers

    hooks = webhook.webhooks(
        handlers.HOOKS, "a.validate.dsv4.ai", CLIENT_CONFIGS["url"], ["team-b", "team-a"]
    )
    want = {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}
        ]
    }
    assert [h["namespaceSelector"] for h in hooks] == [want] * len(handlers.HOOKS)
    assert hooks[0]["clientConfig"]["url"] == "https://127.0.0.1:9443/spec"
    assert webhook.namespace_selector([]) is None  # cluster-wide: every namespace


class FakeApi:
    def __init__(self, create_fails: list[int]) -> None:
        self.create_fails, self.calls = create_fails, []

    async def create(self, body: dict) -> dict:
        self.calls.append(("create", body["metadata"]["name"]))
        if self.create_fails:
            raise webhook.ApiError(self.create_fails.pop(0), "", "")
        return body

    async def merge_patch(self, body: dict, patch: dict) -> dict:
        self.calls.append(("patch", sorted(patch)))
        return body


@pytest.mark.parametrize(
    ("fails", "calls"),
    [
        ([], [("create", "cfg")]),  # absent: created with its webhooks
        ([409], [("create", "cfg"), ("patch", ["webhooks"])]),  # the chart's empty one: webhooks patched
        ([503, 409], [("create", "cfg"), ("create", "cfg"), ("patch", ["webhooks"])]),  # retried
    ],
)
async def test_register_creates_or_replaces_the_webhooks(fails: list[int], calls: list) -> None:
    api = FakeApi(fails)
    await webhook.register(api, "cfg", [], attempts=3)  # type: ignore[arg-type]
    assert api.calls == calls


async def test_register_gives_up_on_a_refusal() -> None:
    api = FakeApi([403])
    with pytest.raises(webhook.ApiError):
        await webhook.register(api, "cfg", [])  # type: ignore[arg-type]
    assert api.calls == [("create", "cfg")]


def test_a_namespaced_release_leaves_other_namespaces_to_their_release() -> None:
    from dsv4_operator import handlers
    from dsv4_operator.config import Config

    bad = yaml.safe_load(sorted((ROOT / "examples" / "invalid").glob("*.yaml"))[0].read_text())
    memo = kopf.Memo(config=Config(watch_namespaces=("team-a",)))
    bad["metadata"]["namespace"] = "team-b"
    handlers.validate_spec(body=kopf.Body(bad), memo=memo)  # not this release's: admitted here
    bad["metadata"]["namespace"] = "team-a"
    with pytest.raises(kopf.AdmissionError):
        handlers.validate_spec(body=kopf.Body(bad), memo=memo)


async def test_namespaces_without_their_name_label_are_found() -> None:
    """1.20 API servers do not label namespaces with their name: the operator warns about each."""

    class Namespaces:
        async def get(self, api_version: str, kind: str, namespace: None, name: str) -> dict | None:
            labels = {"team-a": {webhook.NAMESPACE_NAME_LABEL: "team-a"}, "team-b": {}}
            return {"metadata": {"name": name, "labels": labels[name]}} if name in labels else None

    got = await webhook.unlabelled(Namespaces(), ["team-b", "team-a", "gone"])  # type: ignore[arg-type]
    assert got == ["gone", "team-b"]
