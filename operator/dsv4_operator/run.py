"""`dsv4 operator`: run the kopf operator against the current cluster (in-cluster or kubeconfig)."""

from __future__ import annotations

import argparse
import asyncio
import logging

import kopf

from .config import Config


def parse_args(argv: list[str]) -> argparse.Namespace:
    d = Config.from_env()
    p = argparse.ArgumentParser(prog="dsv4 operator", description=__doc__)
    where = p.add_mutually_exclusive_group()
    where.add_argument("-n", "--watch-namespace", action="append", default=[], metavar="NS",
                       help="namespace(s) to serve (repeatable); default: all")  # fmt: skip
    where.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace (default)")
    p.add_argument("--namespace", default=d.namespace, help="the operator's own namespace (Secret, Lease)")
    p.add_argument("--resync-seconds", type=float, default=d.resync_seconds)
    p.add_argument(
        "--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL ('' = off)"
    )
    p.add_argument("--metrics-port", type=int, default=d.metrics_port or 9090, help="/metrics port (0 = off)")
    p.add_argument("--webhook", action=argparse.BooleanOptionalAction, default=d.webhook,
                   help="serve the validating admission webhook and manage its configuration")  # fmt: skip
    p.add_argument("--webhook-host", default=d.webhook_host,
                   help="name the API server dials (default dsv4-operator-webhook.NAMESPACE.svc)")  # fmt: skip
    p.add_argument("--webhook-service", default=d.webhook_service,
                   help="in-cluster: register this Service of --namespace instead of a URL")  # fmt: skip
    p.add_argument("--webhook-port", type=int, default=d.webhook_port)
    p.add_argument("--webhook-addr", default=d.webhook_addr)
    p.add_argument("--webhook-secret", default=d.webhook_secret)
    p.add_argument("--webhook-config", default=d.webhook_config)
    p.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=d.leader_elect,
                   help="active/standby through a Lease (run 2+ replicas)")  # fmt: skip
    p.add_argument("--lease-name", default=d.lease_name)
    p.add_argument("--lease-seconds", type=float, default=d.lease_seconds)
    p.add_argument("--identity", default=d.identity)
    p.add_argument("--drain-seconds", type=float, default=d.drain_seconds,
                   help="after the endpoint moves to a new generation, keep the old one this long "
                   "(requests already sent to its router finish)")  # fmt: skip
    p.add_argument("--manage-crd", action=argparse.BooleanOptionalAction, default=d.manage_crd,
                   help="at start, apply the bundled CRD unless the live one is newer (helm upgrade "
                   "never updates crds/)")  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> Config:
    return Config(
        resync_seconds=args.resync_seconds, metrics_port=args.metrics_port, webhook=args.webhook,
        webhook_addr=args.webhook_addr, webhook_port=args.webhook_port, webhook_host=args.webhook_host, webhook_service=args.webhook_service,
        webhook_secret=args.webhook_secret, webhook_config=args.webhook_config, namespace=args.namespace,
        watch_namespaces=tuple(dict.fromkeys(args.watch_namespace)),
        leader_elect=args.leader_elect, lease_name=args.lease_name, lease_seconds=args.lease_seconds,
        identity=args.identity, manage_crd=args.manage_crd, drain_seconds=args.drain_seconds,
    )  # fmt: skip


class QuietWakeups(logging.Filter):
    """Drop kopf's "Handler 'wake-pods' succeeded" lines: one per watched event, they say nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Handler 'wake-") or msg.startswith("Handler 'resource_changed'"))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if not args.verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(QuietWakeups())
    from . import handlers  # registers the handlers with kopf's default registry

    namespaces = list(dict.fromkeys(args.watch_namespace))
    asyncio.run(
        kopf.operator(
            registry=kopf.get_default_registry(),
            memo=kopf.Memo(config=config(args)),
            standalone=True,  # no kopf peering: the Lease decides who reconciles
            namespaces=namespaces,
            clusterwide=not namespaces,
            liveness_endpoint=args.liveness or None,
        )
    )
    del handlers
    return 0
