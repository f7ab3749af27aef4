"""kopf handlers for Dsv4Deployment. Each is a few lines; the work is in `reconcile.py`.

One daemon per resource runs a level-triggered loop: reconcile, then sleep until something changes
(the resource, or any child or pod labelled with its name) or the resync period passes. No change
handler writes kopf's progress annotations, so a resync that finds nothing to do writes nothing.
Run it with `dsv4 operator`, or `kopf run -m dsv4_operator.handlers --standalone -A`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import kopf

from . import crd_sync, fingerprint, manifests, metrics, spec, webhook
from .config import WEBHOOK_SERVICE, Config
from .kube import Api, ApiError
from .lease import Lease
from .reconcile import deleting, reconcile
from .wakeups import Wakeups

GROUP, VERSION, PLURAL = "dsv4.ai", "v1alpha1", "dsv4deployments"
CHILD_LABELS = {"dsv4.ai/deployment": kopf.PRESENT}
# Children (and pods) whose changes wake their owner's loop: a deleted or edited child is restored
# without waiting for the resync.
WATCHED = (
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("", "v1", "pods"),
)


def _connect(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.PermanentError("no Kubernetes credentials: no service account and no kubeconfig")
    return info


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    cfg: Config = memo.setdefault("config", Config.from_env())
    settings.posting.level = logging.WARNING  # log lines are not Events; kopf.event() calls are
    # kopf puts this on each resource so that its loop stops before the resource goes (daemons).
    settings.persistence.finalizer = "dsv4.ai/kopf-finalizer"
    memo.wakeups = Wakeups()
    memo.api = Api(on_write=metrics.count_write)
    memo.api.use(_connect(settings))
    if cfg.manage_crd:  # before any watch: the resources are read under the current schema
        await crd_sync.ensure_current(memo.api)
    memo.lease = None
    if cfg.metrics_port:
        metrics.serve(cfg.metrics_port)
    if cfg.webhook:
        await _serve_webhook(settings, memo.api, cfg, logger)
    else:  # kopf insists on a server while admission handlers exist: loopback, unregistered
        settings.admission.server = kopf.WebhookServer(addr="127.0.0.1", host="127.0.0.1", insecure=True)
    if cfg.leader_elect:
        memo.lease = Lease(memo.api, cfg.namespace, cfg.lease_name, cfg.identity, cfg.lease_seconds,
                           on_change=lambda leader: memo.wakeups.poke_all())  # fmt: skip
        memo.lease_task = asyncio.create_task(memo.lease.run())


async def _serve_webhook(
    settings: kopf.OperatorSettings, api: Api, cfg: Config, logger: logging.Logger | logging.LoggerAdapter
) -> None:
    if cfg.webhook_service:  # the name an API server's certificate check expects for a Service
        hosts = [f"{cfg.webhook_service}.{cfg.namespace}.svc"]
    else:
        hosts = [cfg.webhook_host or f"{WEBHOOK_SERVICE}.{cfg.namespace}.svc"]
    cert, key = await webhook.shared_certificate(api, cfg.namespace, cfg.webhook_secret, hosts)
    for ns in await webhook.unlabelled(api, cfg.watch_namespaces):
        logger.warning(
            "namespace %s has no label %s=%s (Kubernetes 1.21+ sets it): this release's webhook "
            "will not judge its resources until it is labelled", ns, webhook.NAMESPACE_NAME_LABEL, ns,
        )  # fmt: skip

    async def registered(client_config: dict[str, Any]) -> None:
        hooks = webhook.webhooks(HOOKS, cfg.webhook_config, client_config, cfg.watch_namespaces)
        await webhook.register(api, cfg.webhook_config, hooks)

    settings.admission.server = webhook.server(
        cert, key, addr=cfg.webhook_addr, port=cfg.webhook_port, host=hosts[0],
        service=(cfg.namespace, cfg.webhook_service) if cfg.webhook_service else None, on_config=registered,
    )  # fmt: skip
    # settings.admission.managed stays None: the configuration is ours to write (webhook.py says why).


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if memo.get("lease_task"):
        memo.lease_task.cancel()
        await memo.lease.release()  # a standby takes over at once
    await memo.api.close()


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    return memo.api.info


# The validation handlers, as registered with the API server (webhook.webhooks): one, the spec model.
SPEC_HOOK = webhook.Hook("spec", GROUP, VERSION, PLURAL, ("CREATE", "UPDATE"))
HOOKS = (SPEC_HOOK,)


# persistent: an exiting replica leaves the registration alone (the Service still reaches the others).
@kopf.on.validate(
    GROUP, VERSION, PLURAL, id=SPEC_HOOK.id, operations=list(SPEC_HOOK.operations), persistent=True
)
def validate_spec(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    watched = memo.config.watch_namespaces
    if watched and body.metadata.namespace not in watched:
        return  # another release's to judge (a registration without namespaceSelector sent it)
    webhook.validate(body, spec.parse)


@kopf.on.probe(id="role")
def probe(memo: kopf.Memo, **_: Any) -> str:
    return "leader" if memo.lease is None or memo.lease.leader else "standby"


@kopf.on.event(GROUP, VERSION, PLURAL)
def resource_changed(meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    memo.wakeups.poke(meta.namespace, meta.name)


def child_changed(labels: kopf.Labels, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    memo.wakeups.poke(namespace, labels["dsv4.ai/deployment"])


for _group, _version, _plural in WATCHED:
    kopf.on.event(_group, _version, _plural, labels=CHILD_LABELS, id=f"wake-{_plural}")(child_changed)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def reconciler(
    body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, stopped: kopf.DaemonStopped, logger: logging.Logger,
    **_: Any,
) -> None:  # fmt: skip
    def event(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)

    while not stopped:
        out = None
        if (memo.lease is None or memo.lease.leader) and not deleting(body):
            with metrics.timed_reconcile():
                try:
                    out = await reconcile(
                        memo.api, body, render=manifests.render, parse=spec.parse,
                        fingerprint=fingerprint.deployment_fingerprint, event=event,
                        drain_seconds=memo.config.drain_seconds,
                    )  # fmt: skip
                except (TimeoutError, ApiError, OSError, aiohttp.ClientError) as e:
                    # kopf restarts the daemon after the delay: a retry with a fresh read.
                    raise kopf.TemporaryError(f"reconcile {meta.namespace}/{meta.name}: {e}", delay=5) from e
            if out.writes:
                logger.info("applied %s, deleted %s, status %s", out.applied, out.deleted, out.status_written)
        else:  # a standby's figures would go stale beside the leader's
            metrics.forget_resource(meta.namespace or "default", meta.name)
        wait = memo.config.resync_seconds
        if out is not None and out.recheck_in is not None:  # an old generation's drain ends sooner
            wait = min(wait, out.recheck_in + 0.5)
        await memo.wakeups.wait(meta.namespace, meta.name, wait, stopped, settle=0.2)
    memo.wakeups.forget(meta.namespace, meta.name)
    metrics.forget_resource(meta.namespace or "default", meta.name)
