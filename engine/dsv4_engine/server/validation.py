"""How request bodies are validated: strict types, unknown top-level fields dropped and reported,
fields accepted only as "off", and the checks the OpenAI bodies and /generate's share.

Every field a model declares is either honoured or rejected with a 400 that names it: fields we
cannot honour accept only the value that means "feature off" (`off`; sglang-router 0.3.2
re-serialises requests and always sends some of those, e.g. `no_stop_trim: false`). A top-level
field a request model does not declare is some other server's extension (`nvext`,
`return_routed_experts`): `RequestBody` drops it and lists it in `ignored_fields` (the routes log it
once and answer with an `x-dsv4-ignored-fields` header), as vLLM does. Nested objects
(`messages[i]`, `stream_options`, `sampling_params`) stay strict. Types are strict: `"16"` is not an
integer, `1` is not a boolean.
"""

from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    model_validator,
)

from dsv4_engine.server.errors import UNSUPPORTED_MARK

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_N = 128  # OpenAI's limit on choices per request
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limits
MAX_COMPLETION_LOGPROBS = 5
LOGIT_BIAS_LIMIT = 100.0
I64 = 2**63

TokenIds = list[int]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class RequestBody(Strict):
    """A whole request body: undeclared top-level fields are dropped and listed in `ignored_fields`,
    except the ones OpenAI defines (`openai_fields`), which stay and fail as unsupported."""

    openai_fields: ClassVar[frozenset[str]] = frozenset()
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _drop_unknown(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        ignored: list[str] = []
        if isinstance(data, dict):
            known = cls.model_fields.keys() | cls.openai_fields
            ignored = [k for k in data if k not in known]
            if ignored:
                data = {k: v for k, v in data.items() if k in known}
        model = handler(data)
        model._ignored = ignored
        return model

    @property
    def ignored_fields(self) -> list[str]:
        """Top-level fields of the request that this server does not know and did not use."""
        return list(self._ignored)


def _same(value: Any, ok: Any) -> bool:
    if isinstance(ok, bool) or isinstance(value, bool):
        return value is ok
    if isinstance(ok, float) and isinstance(value, int | float):
        return value == ok
    return type(value) is type(ok) and value == ok


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def off(*allowed: Any) -> Any:
    """Type of a field we cannot honour: only the listed 'feature off' values pass."""

    def check(value: Any) -> Any:
        if any(_same(value, ok) for ok in allowed):
            return value
        raise ValueError(f"is {UNSUPPORTED_MARK} (accepted: {', '.join(map(_show, allowed))})")

    return Annotated[Any, BeforeValidator(check)]


def valid_top_k(v: int | None) -> int | None:
    if v == 0:
        raise ValueError("top_k must be -1 (disabled) or at least 1")
    return v


def valid_stop(v: str | list[str] | None) -> str | list[str] | None:
    items = [v] if isinstance(v, str) else v or []
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
    if any(not s or len(s) > MAX_STOP_LEN for s in items):
        raise ValueError(f"stop sequences must be 1 to {MAX_STOP_LEN} characters")
    return v


def valid_token_ids(v: list[int] | None) -> list[int] | None:
    if v is not None and any(t < 0 or t >= I64 for t in v):
        raise ValueError("token ids must be non-negative")
    return v


def valid_logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    for key, bias in (v or {}).items():
        if not key.isascii() or not key.isdigit():
            raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"bias values must be in [-100, 100], got {bias} for token {key}")
    return v


def logit_bias_ids(v: dict[str, float] | None) -> dict[int, float] | None:
    """The checked `logit_bias` with integer keys (JSON object keys are strings)."""
    return {int(k): float(b) for k, b in v.items()} if v else None


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])
