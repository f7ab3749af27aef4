"""Pure-ASGI middleware: x-request-id, API key, body-size limit, one access-log line per request,
and the `x-dsv4-ignored-fields` header of a request whose unknown fields were ignored.

Pure ASGI (not BaseHTTPMiddleware) so that streaming responses and disconnect detection pass through
untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from typing import Any
from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsv4_engine.server.errors import error_body

log = logging.getLogger("dsv4.server.access")

REQUEST_ID_HEADER = "x-request-id"
IGNORED_FIELDS_HEADER = "x-dsv4-ignored-fields"
IGNORED_FIELDS_STATE = "ignored_fields"  # request.state key a route sets (call.report_ignored)
MAX_LISTED_FIELDS = 32  # a header (and log line) stays small whatever the body holds
MAX_BODY_BYTES = 32 * 1024 * 1024
_OPEN_PATHS = {"/health", "/metrics"}  # probes and scrapers carry no key
_QUIET_PATHS = {"/health", "/metrics", "/get_load"}  # polled constantly: log at debug only
_VALID_ID = re.compile(r"^[A-Za-z0-9._:/=+\-]{1,128}$")


def field_list(names: list[str]) -> str:
    """Comma-separated, each name percent-encoded: JSON keys may hold commas, CR/LF or non-ASCII,
    none of which may reach a header or a log line as they are."""
    shown = [quote(n, safe="") or '""' for n in names[:MAX_LISTED_FIELDS]]
    if len(names) > MAX_LISTED_FIELDS:
        shown.append(f"...({len(names) - MAX_LISTED_FIELDS} more)")
    return ",".join(shown)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_json(
    send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]
) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class ServingMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        given = _header(scope, b"x-request-id")
        # Accept the caller's id (PD carries it across servers) unless it could corrupt logs.
        request_id = given if given and _VALID_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (b"x-request-id", request_id.encode())
        path = scope.get("path", "")
        status_holder = {"status": 0}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_holder["status"] = message["status"]
                extra = [id_header]
                # Set by the route before it answers (errors and streams included).
                ignored = scope["state"].get(IGNORED_FIELDS_STATE)
                if ignored:
                    extra.append((IGNORED_FIELDS_HEADER.encode(), field_list(ignored).encode()))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        try:
            if self._key is not None and path not in _OPEN_PATHS and not self._authorised(scope):
                await _send_json(
                    send_with_id,
                    401,
                    error_body("Incorrect or missing API key.", code="invalid_api_key"),
                    [(b"www-authenticate", b"Bearer")],
                )
                return
            length = _header(scope, b"content-length")
            if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
                await _send_json(
                    send_with_id,
                    413,
                    error_body(f"request body larger than {MAX_BODY_BYTES} bytes", code="request_too_large"),
                    [],
                )
                return
            await self.app(scope, receive, send_with_id)
        finally:
            level = logging.DEBUG if path in _QUIET_PATHS else logging.INFO
            log.log(
                level,
                '%s "%s %s" %d %.1fms x-request-id=%s',
                (scope.get("client") or ("-", 0))[0],
                scope.get("method", "-"),
                path,
                status_holder["status"],
                (time.monotonic() - started) * 1000,
                request_id,
            )

    def _authorised(self, scope: Scope) -> bool:
        assert self._key is not None
        auth = _header(scope, b"authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self._key)
