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
    srv = webhook.server(cert, key, directory=tmp_path, addr="127.0.0.1", port=0, host="ignored",
                         service=("ops", "dsv4-operator-webhook"))  # fmt: skip
    configs = srv(lambda **_: None)
    try:
        config = await anext(configs)
    finally:
        await configs.aclose()
    assert config["service"] == {"namespace": "ops", "name": "dsv4-operator-webhook", "port": 0}
    assert base64.b64decode(config["caBundle"]) == cert
