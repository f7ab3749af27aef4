"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4_engine.server.streaming import ClientGone

# Pydantic error types that mean "wrong JSON type" rather than "bad value".
_TYPE_ERRORS = ("_type", "model_attributes_type", "is_instance_of")
UNSUPPORTED_MARK = "not supported by this server"


class ApiError(Exception):
    """An error the client should see as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, *, retry_after: int = 1, code: str = "service_unavailable") -> ApiError:
    return ApiError(
        503, message, type="service_unavailable", code=code, headers={"Retry-After": str(retry_after)}
    )


def param_path(loc: tuple[Any, ...]) -> str | None:
    """`("body", "messages", 0, "content")` -> `messages[0].content`; union-member tags dropped."""
    parts: list[str] = []
    for item in loc:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item.isidentifier() and item not in ("str", "int", "float", "bool"):
            parts.append(("." if parts else "") + item)
        # else: a pydantic union tag such as "list[int]" or "function-after[...]"
    return "".join(parts) or None


def from_validation_errors(errors: list[dict[str, Any]]) -> ApiError:
    """Pick the most useful pydantic error and phrase it like OpenAI does."""
    if not errors:
        return bad_request("invalid request")
    # Prefer unknown/unsupported fields: they explain the request better than union noise.
    order = {"json_invalid": 0, "extra_forbidden": 2, "missing": 3}
    err = min(
        errors,
        key=lambda e: order.get(e.get("type", ""), 1 if UNSUPPORTED_MARK in str(e.get("msg", "")) else 4),
    )
    kind = err.get("type", "")
    loc = tuple(err.get("loc", ()))
    param = param_path(loc)
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return bad_request(f"request body is not valid JSON: {detail}".rstrip(": "), None, "invalid_json")
    if kind == "extra_forbidden" and param is not None and param.isidentifier():
        # Unknown top-level fields are dropped before validation (validation.RequestBody); one that is
        # still here is a field OpenAI defines that the model does not declare.
        return bad_request(f"'{param}' is {UNSUPPORTED_MARK}", param, "unsupported_parameter")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing":
        return bad_request(f"'{param}' is a required property", param, "missing_required_parameter")
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        return bad_request(msg, None, "invalid_value")
    if UNSUPPORTED_MARK in msg:
        return bad_request(f"'{param}' {msg}", param, "unsupported_parameter")
    if any(kind.endswith(t) for t in _TYPE_ERRORS):
        return bad_request(f"Invalid type for '{param}': {msg}", param, "invalid_type")
    return bad_request(f"Invalid value for '{param}': {msg}", param, "invalid_value")


def _response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def install_handlers(app: FastAPI) -> None:
    """Every error leaves the server in the OpenAI shape, including FastAPI's own 404/405/422; a client
    that left before its answer was ready gets an empty 499."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _response(exc)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the access log does

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _response(from_validation_errors(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse(
            error_body(detail, code=code), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", type="internal_error", code="internal_error"),
            status_code=500,
        )
