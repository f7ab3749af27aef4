"""Operator settings: command-line flags of `dsv4 operator`, each with a DSV4_OPERATOR_* env default
(so `kopf run -m dsv4_operator.handlers` picks them up too)."""

from __future__ import annotations

import dataclasses
import os
import socket


def _env(name: str, default: str) -> str:
    return os.environ.get(f"DSV4_OPERATOR_{name}", default)


def _flag(name: str, default: bool) -> bool:
    return _env(name, "1" if default else "0").lower() in ("1", "true", "yes", "on")


# Default names of what the operator keeps in its namespace or the cluster. The Helm chart passes
# per-release names instead (flags), so that two releases never share one of these.
WEBHOOK_SECRET = "dsv4-operator-webhook-tls"
WEBHOOK_CONFIG = "validate.dsv4.ai"  # the ValidatingWebhookConfiguration kopf manages
WEBHOOK_SERVICE = "dsv4-operator-webhook"  # without --webhook-host/--webhook-service: SERVICE.NAMESPACE.svc
LEASE_NAME = "dsv4-operator"


@dataclasses.dataclass
class Config:
    resync_seconds: float = 60.0  # periodic level-triggered reconcile of every resource
    metrics_port: int = 0  # 0: no /metrics server
    webhook: bool = False
    webhook_addr: str = "0.0.0.0"
    webhook_port: int = 9443
    webhook_host: str = ""  # the name the API server dials by URL; also a certificate SAN
    webhook_service: str = ""  # in-cluster: register this Service (in `namespace`) instead of a URL
    webhook_secret: str = WEBHOOK_SECRET
    webhook_config: str = WEBHOOK_CONFIG
    namespace: str = "default"  # where the operator runs: its Secret and Lease live here
    # The namespaces served (empty: every one); the webhook is registered for these only.
    watch_namespaces: tuple[str, ...] = ()
    leader_elect: bool = False
    lease_name: str = LEASE_NAME
    lease_seconds: float = 15.0
    identity: str = dataclasses.field(default_factory=socket.gethostname)
    manage_crd: bool = True  # keep the Dsv4Deployment CRD current at start (crd_sync.py)
    # After the endpoint moves to a new generation, the old one is kept this long (reconcile.py).
    drain_seconds: float = 30.0

    @classmethod
    def from_env(cls) -> Config:
        return cls(
            resync_seconds=float(_env("RESYNC_SECONDS", "60")),
            metrics_port=int(_env("METRICS_PORT", "0")),
            webhook=_flag("WEBHOOK", False),
            webhook_addr=_env("WEBHOOK_ADDR", "0.0.0.0"),
            webhook_port=int(_env("WEBHOOK_PORT", "9443")),
            webhook_host=_env("WEBHOOK_HOST", ""),
            webhook_service=_env("WEBHOOK_SERVICE", ""),
            webhook_secret=_env("WEBHOOK_SECRET", WEBHOOK_SECRET),
            webhook_config=_env("WEBHOOK_CONFIG", WEBHOOK_CONFIG),
            namespace=_env("NAMESPACE", os.environ.get("POD_NAMESPACE", "default")),
            watch_namespaces=tuple(n for n in _env("WATCH_NAMESPACES", "").split(",") if n),
            leader_elect=_flag("LEADER_ELECT", False),
            lease_name=_env("LEASE_NAME", LEASE_NAME),
            lease_seconds=float(_env("LEASE_SECONDS", "15")),
            identity=_env("IDENTITY", os.environ.get("POD_NAME", socket.gethostname())),
            manage_crd=_flag("MANAGE_CRD", True),
            drain_seconds=float(_env("DRAIN_SECONDS", "30")),
        )
