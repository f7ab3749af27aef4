"""The Dsv4Deployment CRD (`crds/dsv4deployment.yaml`, the one source of truth) and its variant for
clusters without CEL.

Kubernetes < 1.25 has no `x-kubernetes-validations`: its API server drops the unknown key, but
kubectl's client-side validation rejects the whole CRD ("unknown field x-kubernetes-validations").
`load_crd(cel=False)` (CLI: `dsv4 render --crd --no-cel`) returns the same CRD without those keys;
the operator's admission webhook enforces the same rules through the pydantic model.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import yaml

CRD_FILE = "dsv4deployment.yaml"
CEL_KEY = "x-kubernetes-validations"


def crd_path() -> Path:
    """`$DSV4_CRD_PATH`, else the copy packaged with dsv4_operator (a link to crds/ in a checkout),
    else crds/ beside the package in a source tree."""
    override = os.environ.get("DSV4_CRD_PATH")
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent
    for candidate in (here / "data" / CRD_FILE, here.parents[1] / "crds" / CRD_FILE):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{CRD_FILE} not found; set DSV4_CRD_PATH")


def strip_cel(node: Any) -> Any:
    """A copy of `node` without any `x-kubernetes-validations` key, at any depth."""
    if isinstance(node, dict):
        return {k: strip_cel(v) for k, v in node.items() if k != CEL_KEY}
    if isinstance(node, list):
        return [strip_cel(v) for v in node]
    return node


@functools.cache
def _crd_json(path: Path, mtime_ns: int) -> str:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return json.dumps(yaml.load(path.read_text(), Loader=loader))


def load_crd(*, cel: bool = True) -> dict[str, Any]:
    """The CRD as a fresh plain dict (YAML anchors expanded into independent copies)."""
    path = crd_path()
    crd = json.loads(_crd_json(path, path.stat().st_mtime_ns))
    return crd if cel else strip_cel(crd)


def openapi_schema(crd: dict[str, Any] | None = None, version: str = "v1alpha1") -> dict[str, Any]:
    crd = crd or load_crd()
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"CRD has no version {version}")


def crd_yaml(*, cel: bool = True) -> str:
    return yaml.safe_dump(load_crd(cel=cel), sort_keys=False, width=120)
