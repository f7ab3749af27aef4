"""Offline validation of an object against the CRD, the way a Kubernetes 1.25+ API server does it:
structural defaults, the OpenAPI schema (through `jsonschema`) and the CEL rules (through
`cel-python`). Used by the drift tests; `jsonschema` and `celpy` come with the `test` extra and are
imported only here.

Unknown fields count as errors: the API server prunes them, kubectl (`--validate=strict`, its default)
rejects them, and so does the pydantic model.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from dsv4_operator.crd import CEL_KEY
from dsv4_operator.crd import openapi_schema as _load_schema

Errors = list[tuple[str, str]]
_SCALAR_KEYS = (
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "multipleOf",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
    "required",
)


@functools.cache
def openapi_schema() -> dict[str, Any]:
    return _load_schema()  # read once per process; callers must not mutate it


def to_jsonschema(s: dict[str, Any]) -> dict[str, Any]:
    """Translate a structural schema into JSON Schema."""
    if s.get("x-kubernetes-int-or-string"):
        string: dict[str, Any] = {"type": "string"}
        if "pattern" in s:
            string["pattern"] = s["pattern"]
        return {"anyOf": [{"type": "integer"}, string]}
    out: dict[str, Any] = {k: s[k] for k in _SCALAR_KEYS if k in s}
    if "type" in s:
        out["type"] = [s["type"], "null"] if s.get("nullable") else s["type"]
    if "properties" in s:
        out["properties"] = {k: to_jsonschema(v) for k, v in s["properties"].items()}
        if not s.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(s.get("additionalProperties"), dict):
        out["additionalProperties"] = to_jsonschema(s["additionalProperties"])
    if "items" in s:
        out["items"] = to_jsonschema(s["items"])
    for key in ("oneOf", "anyOf", "allOf"):
        if key in s:
            out[key] = [to_jsonschema(x) for x in s[key]]
    return out


def apply_defaults(x: Any, s: dict[str, Any]) -> None:
    """Structural defaulting, in place: a missing property with a default gets it, then defaulting
    continues inside the value (so `engine: {}` fills in every engine default)."""
    if isinstance(x, dict):
        props = s.get("properties", {})
        for key, ps in props.items():
            if key not in x and "default" in ps:
                x[key] = copy.deepcopy(ps["default"])
            if key in x:
                apply_defaults(x[key], ps)
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            for key in x.keys() - props.keys():
                apply_defaults(x[key], extra)
    elif isinstance(x, list) and "items" in s:
        for item in x:
            apply_defaults(item, s["items"])


def _fmt(path: list[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out or "(root)"


@functools.cache
def _program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(x: Any, s: dict[str, Any], path: list[Any] | None = None) -> Errors:
    """Evaluate every `x-kubernetes-validations` rule on the values present; a rule that does not
    evaluate to true (false, or an evaluation error) is a rejection, as in the API server."""
    import celpy

    path = path or []
    out: Errors = []
    rules = s.get(CEL_KEY, [])
    activation = {"self": celpy.json_to_cel(x)} if rules else {}
    for rule in rules:
        try:
            ok = _program(rule["rule"]).evaluate(activation)
        except Exception as exc:  # CELEvalError and friends: the server rejects too
            ok = exc
        if ok is not True and not (isinstance(ok, celpy.celtypes.BoolType) and bool(ok)):
            out.append((_fmt(path), rule.get("message") or f"failed rule: {rule['rule']}"))
    if isinstance(x, dict):
        props = s.get("properties", {})
        for key, value in x.items():
            sub = props[key] if key in props else s.get("additionalProperties")
            if isinstance(sub, dict):
                out += cel_errors(value, sub, [*path, key])
    elif isinstance(x, list) and "items" in s:
        for i, item in enumerate(x):
            out += cel_errors(item, s["items"], [*path, i])
    return out


def list_map_errors(x: Any, s: dict[str, Any], path: list[Any] | None = None) -> Errors:
    """`x-kubernetes-list-type: map` keys must be unique (the API server checks this, jsonschema can't)."""
    path = path or []
    out: Errors = []
    if isinstance(x, list):
        if s.get("x-kubernetes-list-type") == "map":
            keys = s.get("x-kubernetes-list-map-keys", [])
            seen: set[tuple[Any, ...]] = set()
            for i, item in enumerate(x):
                k = tuple(json_key(item, key) for key in keys)
                if k in seen:
                    out.append(
                        (_fmt([*path, i]), f"duplicate entry for key {dict(zip(keys, k, strict=True))}")
                    )
                seen.add(k)
        for i, item in enumerate(x):
            out += list_map_errors(item, s.get("items", {}), [*path, i])
    elif isinstance(x, dict):
        for key, value in x.items():
            sub = s.get("properties", {}).get(key)
            if isinstance(sub, dict):
                out += list_map_errors(value, sub, [*path, key])
    return out


def json_key(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, dict) else None


@functools.cache
def _validator() -> Any:
    import jsonschema

    schema = to_jsonschema(openapi_schema())
    # ObjectMeta: the CRD constrains only name; the server owns every other field.
    schema["properties"]["metadata"].pop("additionalProperties", None)
    return jsonschema.Draft7Validator(schema)


def validate(obj: dict[str, Any], *, cel: bool = True) -> Errors:
    """All errors a Kubernetes 1.25+ API server would report for `obj` (defaults applied first)."""
    schema = openapi_schema()
    x = copy.deepcopy(obj)
    apply_defaults(x, schema)
    out: Errors = [(_fmt(list(e.absolute_path)), e.message) for e in _validator().iter_errors(x)]
    out += list_map_errors(x, schema)
    if cel:
        out += cel_errors(x, schema)
    return out


def defaulted(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` after the CRD's structural defaults, as the API server would store it."""
    x = copy.deepcopy(obj)
    apply_defaults(x, openapi_schema())
    return x
