"""The CRD itself: API names, subresources, printer columns, a structural schema whose defaults are
valid, CEL rules that compile and are each exercised, and the variant for clusters without CEL."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dsv4_operator import crdcheck
from dsv4_operator.crd import CEL_KEY, crd_path, crd_yaml, load_crd, openapi_schema

ROOT = Path(__file__).resolve().parents[2]
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))

# Every key apiextensions.k8s.io/v1 JSONSchemaProps has in Kubernetes 1.20 (and up to 1.24).
JSONSCHEMAPROPS_1_20 = {
    "id", "$schema", "$ref", "description", "type", "format", "title", "default", "maximum",
    "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems",
    "minItems", "uniqueItems", "multipleOf", "enum", "maxProperties", "minProperties", "required", "items",
    "allOf", "oneOf", "anyOf", "not", "properties", "additionalProperties", "patternProperties",
    "dependencies", "additionalItems", "definitions", "externalDocs", "example", "nullable",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource", "x-kubernetes-int-or-string",
    "x-kubernetes-list-map-keys", "x-kubernetes-list-type", "x-kubernetes-map-type",
}  # fmt: skip


def schema_nodes(s: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node under properties / items / additionalProperties, with its path."""
    out = [(path, s)]
    for key, sub in s.get("properties", {}).items():
        out += schema_nodes(sub, f"{path}.{key}")
    if isinstance(s.get("items"), dict):
        out += schema_nodes(s["items"], f"{path}[]")
    if isinstance(s.get("additionalProperties"), dict):
        out += schema_nodes(s["additionalProperties"], f"{path}{{}}")
    return out


def test_crd_names_follow_the_contract() -> None:
    crd = load_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "dsv4deployments.dsv4.ai"
    assert (spec["group"], spec["scope"]) == ("dsv4.ai", "Namespaced")
    assert spec["names"]["kind"] == "Dsv4Deployment"
    assert spec["names"]["plural"] == "dsv4deployments"
    assert spec["names"]["shortNames"] == ["dsv4"]
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]


def test_subresources_and_printer_columns() -> None:
    version = load_crd()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.decode.replicas",
        "statusReplicasPath": ".status.decode.replicas",
        "labelSelectorPath": ".status.decode.selector",
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Prefill"] == ".status.prefill.readyReplicas"
    assert columns["Decode"] == ".status.decode.readyReplicas"
    assert columns["Endpoint"] == ".status.endpoint"
    assert columns["Reason"] == '.status.conditions[?(@.type=="Ready")].reason'  # why it is not Ready
    assert list(columns).index("Reason") == list(columns).index("Ready") + 1
    assert columns["Age"] == ".metadata.creationTimestamp"
    status = openapi_schema()["properties"]["status"]["properties"]
    assert status["decode"]["properties"]["selector"]["type"] == "string"


@pytest.mark.parametrize("cel", [True, False], ids=["cel", "no-cel"])
def test_crd_is_a_valid_kubernetes_object(cel: bool) -> None:
    kubernetes_validate.validate(load_crd(cel=cel), "1.30.0", strict=True)


def test_schema_is_structural() -> None:
    for path, node in schema_nodes(openapi_schema()):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
        else:
            assert "type" in node, f"{path or '(root)'} has no type"
        for branch in node.get("oneOf", []) + node.get("anyOf", []):
            assert set(branch) <= {"required", "not", "pattern", "enum"}, f"{path}: value validations only"
        if node.get("type") == "object" and "properties" in node:
            assert "additionalProperties" not in node, path


def test_every_default_is_valid_after_nested_defaulting() -> None:
    for path, node in schema_nodes(openapi_schema()):
        if "default" not in node:
            continue
        value = copy.deepcopy(node["default"])
        crdcheck.apply_defaults(value, node)
        errors = list(jsonschema.Draft7Validator(crdcheck.to_jsonschema(node)).iter_errors(value))
        assert not errors, f"{path}: {errors[0].message}"
        assert crdcheck.cel_errors(value, node) == [], path


def test_every_cel_rule_compiles_and_is_exercised_by_an_invalid_example() -> None:
    messages = {r["message"] for _, n in schema_nodes(openapi_schema()) for r in n.get(CEL_KEY, [])}
    assert len(messages) >= 20
    hit = {m for f in INVALID for _, m in crdcheck.validate(yaml.safe_load(f.read_text()))}
    assert messages - hit == set(), "CEL rules no invalid example exercises"


def test_no_cel_variant_drops_only_the_rules() -> None:
    full, stripped = load_crd(cel=True), load_crd(cel=False)
    assert CEL_KEY not in yaml.safe_dump(stripped)
    for path, node in schema_nodes(openapi_schema(stripped)):
        unknown = set(node) - JSONSCHEMAPROPS_1_20
        assert not unknown, f"{path}: {unknown} unknown to Kubernetes 1.20"
    # Put the rules back by walking both: nothing else differs.
    for (p1, n1), (p2, n2) in zip(
        schema_nodes(openapi_schema(full)), schema_nodes(openapi_schema(stripped)), strict=True
    ):
        assert p1 == p2
        assert {
            k: v for k, v in n1.items() if k not in (CEL_KEY, "properties", "items", "additionalProperties")
        } == {k: v for k, v in n2.items() if k not in ("properties", "items", "additionalProperties")}, p1


def test_packaged_crd_is_the_one_in_crds() -> None:
    assert crd_path().resolve() == (ROOT / "crds" / "dsv4deployment.yaml").resolve()


@pytest.mark.parametrize("cel", [True, False], ids=["cel", "no-cel"])
def test_render_prints_the_crd(cel: bool) -> None:
    argv = ["--crd"] + ([] if cel else ["--no-cel"])
    code = "import sys; from dsv4_operator.render import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == crd_yaml(cel=cel)
    assert yaml.safe_load(result.stdout) == load_crd(cel=cel)
