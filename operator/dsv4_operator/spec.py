"""`parse`: a `Dsv4Deployment` object checked against the pydantic model (`spec_types.py`) and the
cross-field rules (`spec_rules.py`), every problem reported as a (field path, reason) pair.

The model's names are importable from here as well (`from dsv4_operator.spec import Dsv4Deployment`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from dsv4_operator.spec_rules import check
from dsv4_operator.spec_types import *  # noqa: F403  (re-exported: the model's public names)
from dsv4_operator.spec_types import Dsv4Deployment


class SpecError(ValueError):
    """A rejected spec. `.errors` lists (field path, reason); str() names every field."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(f"{path}: {reason}" for path, reason in self.errors))


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(root)"


def _reason(err: dict[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field"
    if err["type"] == "missing":
        return "required field is missing"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


def parse(obj: dict[str, Any]) -> Dsv4Deployment:
    """Validate a `Dsv4Deployment` object (as read from YAML or the API); raise `SpecError` listing
    every problem found."""
    if not isinstance(obj, dict):
        raise SpecError([("(root)", "a Dsv4Deployment must be a mapping")])
    try:
        dep = Dsv4Deployment.model_validate(obj)
    except ValidationError as exc:
        raise SpecError([(_path(e["loc"]), _reason(e)) for e in exc.errors()]) from None
    problems = check(dep)
    if problems:
        raise SpecError(problems)
    return dep
