"""The CRD and the pydantic model cannot drift: every example, valid or not, and random specs get the
same verdict from both (the CRD through its OpenAPI schema and its CEL rules, evaluated offline), and
the CRD's defaults equal the model's."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_operator import crdcheck
from dsv4_operator.manifests import render
from dsv4_operator.spec import SpecError, parse

ROOT = Path(__file__).resolve().parents[2]
VALID = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))


def model_errors(obj: Any) -> list[tuple[str, str]]:
    try:
        parse(obj)
    except SpecError as exc:
        return exc.errors
    return []


def breaks(path: Path) -> str:
    match = re.search(r"^# breaks: (\S+)", path.read_text(), re.M)
    assert match, f"{path.name} lacks a '# breaks: FIELD' line"
    return match.group(1)


def relates(err_path: str, message: str, field: str) -> bool:
    """An error is about `field` if it sits at the field (or inside it), or sits on an enclosing
    object and its message names the field relative to that object (how CEL rules report)."""
    if err_path == field or err_path.startswith(field + ".") or err_path.startswith(field + "["):
        return True
    prefix = "" if err_path == "(root)" else err_path
    if prefix and not (field.startswith(prefix + ".") or field.startswith(prefix + "[")):
        return False
    rel = field[len(prefix) :].lstrip(".")
    return rel in message or (rel.split(".")[-1] in message and "." not in rel)


def test_enough_examples() -> None:
    assert len(VALID) >= 3
    assert len(INVALID) >= 20


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_example_passes_both(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert model_errors(obj) == []
    assert crdcheck.validate(obj) == []


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_crd_defaults_equal_model_defaults(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert crdcheck.defaulted(obj)["spec"] == parse(obj).spec_dict()


def test_crd_defaults_equal_model_defaults_for_every_optional_section(minimal: dict[str, Any]) -> None:
    # Every optional section present but empty: the nested defaults must agree field by field.
    for key in ("engine", "prefill", "decode", "router", "service", "ascend", "rollout", "probes"):
        minimal["spec"][key] = {}
    minimal["spec"]["apiKeySecret"] = {"name": "k"}
    minimal["spec"]["engine"]["env"] = [{"name": "X"}]
    assert crdcheck.defaulted(minimal)["spec"] == parse(minimal).spec_dict()


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_example_fails_both_at_its_field(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    field = breaks(path)
    m_errs = model_errors(obj)
    c_errs = crdcheck.validate(obj)
    assert m_errs, "the pydantic model accepted it"
    assert c_errs, "the CRD (schema + CEL) accepted it"
    assert any(p == field or p.startswith(field) for p, _ in m_errs), m_errs
    assert any(relates(p, msg, field) for p, msg in c_errs), c_errs


def test_cel_rules_carry_the_cross_field_checks(minimal: dict[str, Any]) -> None:
    # Without CEL the same object passes the OpenAPI schema: the rule lives in CEL (and the webhook).
    minimal["spec"]["engine"] = {"pageSize": 256, "chunkedPrefillSize": 8320}
    assert crdcheck.validate(minimal, cel=False) == []
    assert crdcheck.validate(minimal) == [
        ("spec", "engine.chunkedPrefillSize must be a multiple of engine.pageSize")
    ]


# Random specs: values chosen around every rule's boundary, each field present or absent.
def _opt(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.just(None), strategy)


ROLE = st.fixed_dictionaries(
    {
        "replicas": _opt(st.sampled_from([0, 1, 3, -1])),
        "npusPerPod": _opt(st.sampled_from([0, 1, 4, 8, 16, 17])),
        "tensorParallelSize": _opt(st.sampled_from([1, 2, 4, 8, 16, 0])),
        "expertParallelSize": _opt(st.sampled_from([1, 2, 3, 4, 8])),
        "sharedMemorySize": _opt(st.sampled_from(["16Gi", 1024, "1 GB", "500m"])),
        "resources": _opt(
            st.sampled_from(
                [
                    {"limits": {"memory": "1Gi"}},
                    {"requests": {"huawei.com/Ascend910": 8}},
                    {"limits": {"cpu": "x"}},
                ]
            )
        ),
        "tolerations": _opt(
            st.sampled_from(
                [
                    [{"key": "a", "operator": "Exists", "effect": "NoSchedule"}],
                    [{"key": "a", "operator": "Exists", "value": "v"}],
                    [{"operator": "Equal", "value": "v"}],
                    [{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}],
                ]
            )
        ),
    }
)
SPEC = st.fixed_dictionaries(
    {
        "engine": _opt(
            st.fixed_dictionaries(
                {
                    "device": _opt(st.sampled_from(["npu", "cuda", "cpu", "tpu"])),
                    "transferProtocol": _opt(st.sampled_from(["tcp", "rdma", "ascend"])),
                    "pageSize": _opt(st.sampled_from([64, 128, 192, 256, 512])),
                    "chunkedPrefillSize": _opt(st.sampled_from([128, 256, 384, 8192, 8320])),
                    "maxModelLen": _opt(st.sampled_from([128, 4096, 8192, 131072, 2**21])),
                    "port": _opt(st.sampled_from([80, 8998, 30000])),
                    "bootstrapPort": _opt(st.sampled_from([8998, 30000])),
                    "env": _opt(
                        st.sampled_from(
                            [[{"name": "A", "value": "1"}], [{"name": "HCCL_IF_IP"}], [{"name": "1A"}]]
                        )
                    ),
                }
            )
        ),
        "prefill": _opt(ROLE),
        "decode": _opt(ROLE),
        "router": _opt(
            st.fixed_dictionaries(
                {
                    "prefillPolicy": _opt(st.sampled_from(["cache_aware", "bucket", "least_loaded"])),
                    "decodePolicy": _opt(st.sampled_from(["round_robin", "bucket"])),
                    "port": _opt(st.sampled_from([8000, 29000])),
                    "replicas": _opt(st.sampled_from([0, 1, 2])),
                }
            )
        ),
        "service": _opt(
            st.fixed_dictionaries(
                {
                    "type": _opt(st.sampled_from(["ClusterIP", "NodePort", "ExternalName"])),
                    "nodePort": _opt(st.sampled_from([30080, 80])),
                }
            )
        ),
        "apiKeySecret": _opt(st.sampled_from([{"name": "key"}, {"name": "Bad_Name"}, {"key": "k"}])),
        "podAnnotations": _opt(st.sampled_from([{"a": "b"}, {"sglang.ai/bootstrap-port": "1"}])),
        "model": _opt(
            st.sampled_from(
                [
                    {"hostPath": {"path": "/m"}},
                    {"image": {"path": "/m/../x"}},
                    {"pvc": {"claimName": "c", "path": "../x"}},
                    {"pvc": {"claimName": "c"}, "image": {"path": "/m"}},
                    {},
                ]
            )
        ),
    }
)


def _prune(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _prune(v) for k, v in x.items() if v is not None}
    return x


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=SPEC)
def test_random_specs_get_the_same_verdict(minimal: dict[str, Any], spec: dict[str, Any]) -> None:
    obj = copy.deepcopy(minimal)
    obj["spec"].update(_prune(spec))
    m_errs, c_errs = model_errors(obj), crdcheck.validate(obj)
    assert bool(m_errs) == bool(c_errs), f"model: {m_errs}\ncrd: {c_errs}"
    if not m_errs:
        dep = parse(obj)
        assert crdcheck.defaulted(obj)["spec"] == dep.spec_dict()
        # Whatever the valid spec, its workloads select their own pods and every name is valid.
        for child in render(dep):
            assert len(child["metadata"]["name"]) <= 63
            if child["kind"] in ("StatefulSet", "Deployment"):
                labels = child["spec"]["template"]["metadata"]["labels"]
                assert child["spec"]["selector"]["matchLabels"].items() <= labels.items()
