"""Fixtures for the foundation tests (spec, CRD, plan, manifests, `dsv4 render`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def minimal_obj() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())


@pytest.fixture
def minimal(minimal_obj: dict[str, Any]) -> dict[str, Any]:
    """A fresh copy of examples/minimal.yaml, as a dict a test may change."""
    return copy.deepcopy(minimal_obj)


@pytest.fixture(scope="session")
def with_spec(minimal_obj: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    """with_spec(engine={...}, decode={...}) -> minimal.yaml with those spec sections merged in
    (`model` is replaced whole: it must hold exactly one source)."""

    def make(**sections: Any) -> dict[str, Any]:
        obj = copy.deepcopy(minimal_obj)
        for key, value in sections.items():
            if key != "model" and isinstance(value, dict) and isinstance(obj["spec"].get(key), dict):
                obj["spec"][key].update(value)
            else:
                obj["spec"][key] = value
        return obj

    return make
