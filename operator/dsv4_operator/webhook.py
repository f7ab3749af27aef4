"""Validating admission for clusters without CEL: the same spec model the operator reconciles with.

The serving certificate is generated once and kept in one Secret, so every replica serves the same
certificate and the caBundle in the ValidatingWebhookConfiguration never flaps.

The operator writes that configuration itself, not kopf (`settings.admission.managed` stays unset):
kopf's writes carry no `namespaceSelector` and replace the whole `webhooks` list (a JSON merge
patch), at each replica's start and again as it exits, so a selector added after it would be gone
in every such window, and for good once the last replica is gone. A release that watches some
namespaces registers a webhook for those namespaces only: two releases side by side never judge
each other's resources, and one release being down never blocks the other's namespaces.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import datetime
import ipaddress
import pathlib
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import kopf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .kube import Api, ApiError

# The label every namespace carries with its own name (the API server sets it, from Kubernetes 1.21;
# on 1.20 whoever creates the namespace must): what a webhook's namespaceSelector can match on.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
CONFIG_API_VERSION = "admissionregistration.k8s.io/v1"
CONFIG_KIND = "ValidatingWebhookConfiguration"
TIMEOUT_SECONDS = 30  # the most the API allows; what kopf registers too


@dataclasses.dataclass(frozen=True)
class Hook:
    """One kopf validation handler, as the API server must be told about it. kopf serves each
    handler at the path /ID of its server, which is where `webhooks` points the API server."""

    id: str
    group: str
    version: str
    plural: str
    operations: tuple[str, ...]


def validate(body: Mapping[str, Any], parse: Any) -> None:
    """Reject a resource the spec model rejects; the message names each field."""
    try:
        parse(dict(body))
    except ValueError as e:
        raise kopf.AdmissionError(str(e), code=422) from e


def namespace_selector(namespaces: Iterable[str]) -> dict[str, Any] | None:
    """Only these namespaces; None (every namespace) for a cluster-wide operator."""
    names = sorted(set(namespaces))
    if not names:
        return None
    return {"matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": names}]}


def webhooks(
    hooks: Iterable[Hook], name: str, client_config: Mapping[str, Any], namespaces: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """The `webhooks` of configuration `name`: kopf's own conventions (tests/operator compares them
    with kopf's), plus the namespaceSelector of the namespaces served."""
    selector = namespace_selector(namespaces)
    out = []
    for hook in hooks:
        cc = copy.deepcopy(dict(client_config))
        if "url" in cc:
            cc["url"] = f"{cc['url'].rstrip('/')}/{hook.id}"
        if "service" in cc:
            cc["service"]["path"] = f"{cc['service'].get('path', '')}/{hook.id}"
        entry: dict[str, Any] = {
            "name": f"{hook.id}.{name}",
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "matchPolicy": "Equivalent",
            "rules": [{"apiGroups": [hook.group], "apiVersions": [hook.version], "resources": [hook.plural],
                       "operations": list(hook.operations), "scope": "*"}],
            "clientConfig": cc,
            "timeoutSeconds": TIMEOUT_SECONDS,
            "admissionReviewVersions": ["v1", "v1beta1"],
        }  # fmt: skip
        if selector is not None:
            entry["namespaceSelector"] = selector
        out.append(entry)
    return out


# Errors worth another try at start (the API server restarting, throttling); others are final.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


async def register(api: Api, name: str, hooks: list[dict[str, Any]], *, attempts: int = 5) -> None:
    """Create configuration `name` with these webhooks, or replace its webhooks (the chart creates
    the object empty, so that `helm uninstall` removes it)."""
    body = {
        "apiVersion": CONFIG_API_VERSION,
        "kind": CONFIG_KIND,
        "metadata": {"name": name},
        "webhooks": hooks,
    }
    for attempt in range(attempts):
        try:
            try:
                await api.create(body)
            except ApiError as e:
                if e.status != 409:
                    raise
                await api.merge_patch(body, {"webhooks": hooks})
            return
        except ApiError as e:
            if e.status not in RETRY_STATUSES or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5 * 2**attempt)


async def unlabelled(api: Api, namespaces: Iterable[str]) -> list[str]:
    """The namespaces a namespaceSelector on NAMESPACE_NAME_LABEL would miss (Kubernetes 1.20)."""
    missing = []
    for ns in sorted(set(namespaces)):
        try:
            got = await api.get("v1", "Namespace", None, ns)
        except ApiError as e:
            if e.status != 403:
                raise
            continue  # may not read namespaces (an account other than the chart's): cannot tell
        labels = ((got or {}).get("metadata") or {}).get("labels") or {}
        if labels.get(NAMESPACE_NAME_LABEL) != ns:
            missing.append(ns)
    return missing


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_certificate(hosts: Sequence[str], days: int = 3650) -> tuple[bytes, bytes]:
    """A self-signed serving certificate (it is its own CA bundle) for the given names and IPs."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


def covers_hosts(cert_pem: bytes, hosts: Sequence[str]) -> bool:
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    names = {str(v) for v in sans.get_values_for_type(x509.DNSName)}
    names |= {str(v) for v in sans.get_values_for_type(x509.IPAddress)}
    fresh = cert.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=7)
    return fresh and all(h in names for h in hosts)


def _pair(secret: Mapping[str, Any]) -> tuple[bytes, bytes] | None:
    data = secret.get("data") or {}
    if "tls.crt" not in data or "tls.key" not in data:
        return None
    return base64.b64decode(data["tls.crt"]), base64.b64decode(data["tls.key"])


async def shared_certificate(
    api: Api, namespace: str, name: str, hosts: Sequence[str]
) -> tuple[bytes, bytes]:
    """The certificate in Secret `name`; the first replica to start creates it, the others read it."""
    secret = await api.get("v1", "Secret", namespace, name)
    pair = _pair(secret) if secret else None
    if pair and covers_hosts(pair[0], hosts):
        return pair
    cert, key = make_certificate(hosts)
    body = {
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/name": "dsv4-operator"}},
        "data": {"tls.crt": base64.b64encode(cert).decode(), "tls.key": base64.b64encode(key).decode()},
    }  # fmt: skip
    try:
        if secret is None:
            await api.create(body)
        else:  # outdated or for other names: replace, guarded by the resourceVersion we read
            body["metadata"]["resourceVersion"] = secret["metadata"]["resourceVersion"]
            await api.replace(body)
    except ApiError as e:
        if e.status != 409:
            raise
        raced = await api.get("v1", "Secret", namespace, name)  # another replica won: use theirs
        pair = _pair(raced) if raced else None
        if pair is None:
            raise kopf.TemporaryError(f"webhook Secret {namespace}/{name} has no certificate", delay=2) from e
        return pair
    return cert, key


def server(
    cert: bytes, key: bytes, *, addr: str, port: int, host: str,
    service: tuple[str, str] | None = None,
    on_config: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
) -> kopf.WebhookServer:  # fmt: skip
    """A TLS admission server; registered by URL (https://host:port), or by `service` (namespace, name).
    `on_config` gets each client config the server yields, before kopf does (the registration)."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix="dsv4-webhook-"))  # 0700; kopf takes paths only
    certfile, keyfile = directory / "tls.crt", directory / "tls.key"
    certfile.write_bytes(cert)
    keyfile.write_bytes(key)
    keyfile.chmod(0o600)
    tls = {"addr": addr, "port": port, "host": host, "certfile": str(certfile), "pkeyfile": str(keyfile),
           "cadata": cert}  # fmt: skip
    svc = None if service is None else {"namespace": service[0], "name": service[1], "port": port}
    return WebhookServer(service=svc, on_config=on_config, directory=directory, **tls)


class WebhookServer(kopf.WebhookServer):
    """kopf's webhook server, optionally registered by Service rather than by URL (API servers seldom
    resolve cluster DNS names, while a `service` reference is what they are built to dial), and
    telling `on_config` of each client config it yields."""

    def __init__(
        self, *, service: Mapping[str, Any] | None = None,
        on_config: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
        directory: pathlib.Path | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.service = dict(service) if service else None
        self.on_config = on_config
        # The certificate files' own folder: kopf re-reads them while it serves (to restart on a
        # renewed certificate), so they go when serving ends.
        self.directory = directory

    async def __call__(self, fn: Any) -> Any:
        try:
            async for config in super().__call__(fn):
                registered: dict[str, Any] = dict(config)
                if self.service is not None:
                    registered = {"service": dict(self.service)}
                    if "caBundle" in config:
                        registered["caBundle"] = config["caBundle"]
                if self.on_config is not None:
                    await self.on_config(registered)
                yield registered
        finally:
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
