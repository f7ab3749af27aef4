"""Validating admission for clusters without CEL: the same spec model the operator reconciles with.

The serving certificate is generated once and kept in one Secret, so every replica serves the same
certificate and the caBundle kopf writes into the ValidatingWebhookConfiguration never flaps.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import kopf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from .kube import Api, ApiError


def validate(body: Mapping[str, Any], parse: Any) -> None:
    """Reject a resource the spec model rejects; the message names each field."""
    try:
        parse(dict(body))
    except ValueError as e:
        raise kopf.AdmissionError(str(e), code=422) from e


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
    cert: bytes, key: bytes, *, directory: pathlib.Path, addr: str, port: int, host: str,
    service: tuple[str, str] | None = None,
) -> kopf.WebhookServer:  # fmt: skip
    """A TLS admission server; registered by URL (https://host:port), or by `service` (namespace, name)."""
    directory.mkdir(parents=True, exist_ok=True)
    certfile, keyfile = directory / "tls.crt", directory / "tls.key"
    certfile.write_bytes(cert)
    keyfile.write_bytes(key)
    keyfile.chmod(0o600)
    tls = {"addr": addr, "port": port, "host": host, "certfile": str(certfile), "pkeyfile": str(keyfile),
           "cadata": cert}  # fmt: skip
    if service is None:
        return kopf.WebhookServer(**tls)
    return ServiceWebhookServer(
        service_namespace=service[0], service_name=service[1], service_port=port, **tls
    )


class ServiceWebhookServer(kopf.WebhookServer):
    """kopf's webhook server, registered by Service rather than by URL: API servers seldom resolve
    cluster DNS names, while a `service` reference is what they are built to dial."""

    def __init__(
        self, *, service_namespace: str, service_name: str, service_port: int, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.service = {"namespace": service_namespace, "name": service_name, "port": service_port}

    async def __call__(self, fn: Any) -> Any:
        async for config in super().__call__(fn):
            registered: dict[str, Any] = {"service": dict(self.service)}
            if "caBundle" in config:
                registered["caBundle"] = config["caBundle"]
            yield registered
