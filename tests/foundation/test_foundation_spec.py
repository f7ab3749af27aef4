"""The pydantic spec: defaults, types, and every cross-field rule naming its field and reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from dsv4_operator.spec import Dsv4Deployment, SpecError, parse

Make = Callable[..., dict[str, Any]]


def errors_of(obj: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        parse(obj)
    return info.value.errors


def test_minimal_gets_documented_defaults(minimal: dict[str, Any]) -> None:
    dep = parse(minimal)
    assert isinstance(dep, Dsv4Deployment)
    s = dep.spec
    assert (s.engine.device, s.engine.transfer_protocol, s.engine.page_size) == ("npu", "ascend", 128)
    assert (s.prefill.npus_per_pod, s.prefill.tensor_parallel_size, s.prefill.expert_parallel_size) == (
        8,
        8,
        1,
    )
    assert s.decode.npu_resource_name == "huawei.com/Ascend910"
    assert (s.router.prefill_policy, s.router.decode_policy) == ("cache_aware", "power_of_two")
    assert (s.service.type, s.service.port) == ("ClusterIP", 8000)
    assert s.probes.startup_timeout_seconds >= 3600
    assert s.pod_security.run_as_user != 0
    assert s.api_key_secret is None


def test_camel_case_only(minimal: dict[str, Any]) -> None:
    minimal["spec"]["decode"] = {"tensor_parallel_size": 8}
    assert errors_of(minimal) == [("spec.decode.tensor_parallel_size", "unknown field")]


def test_types_are_strict(minimal: dict[str, Any]) -> None:
    minimal["spec"]["decode"] = {"replicas": "2", "npusPerPod": 8.0}
    paths = [p for p, _ in errors_of(minimal)]
    assert paths == ["spec.decode.replicas", "spec.decode.npusPerPod"]


def test_spec_error_lists_every_problem_and_names_fields(with_spec: Make) -> None:
    obj = with_spec(engine={"pageSize": 256, "chunkedPrefillSize": 8320, "bootstrapPort": 30000})
    with pytest.raises(SpecError) as info:
        parse(obj)
    paths = [p for p, _ in info.value.errors]
    assert paths == ["spec.engine.chunkedPrefillSize", "spec.engine.bootstrapPort"]
    assert isinstance(info.value, ValueError)
    assert "spec.engine.chunkedPrefillSize: must be a multiple of pageSize (256)" in str(info.value)


def test_not_a_mapping() -> None:
    with pytest.raises(SpecError) as info:
        parse(["not", "a", "mapping"])  # type: ignore[arg-type]
    assert info.value.errors[0][0] == "(root)"


def test_wrong_kind(minimal: dict[str, Any]) -> None:
    minimal["kind"] = "Deployment"
    assert [p for p, _ in errors_of(minimal)] == ["kind"]


# (spec sections to merge, field path expected, words the reason must contain)
RULES = [
    ({"engine": {"pageSize": 192}}, "spec.engine.pageSize", "multiple of 128"),
    ({"engine": {"pageSize": 256, "chunkedPrefillSize": 8320}}, "spec.engine.chunkedPrefillSize", "pageSize"),
    ({"engine": {"maxModelLen": 4096}}, "spec.engine.maxModelLen", "chunkedPrefillSize"),
    ({"engine": {"bootstrapPort": 30000}}, "spec.engine.bootstrapPort", "differ"),
    ({"engine": {"transferProtocol": "tcp"}}, "spec.engine.transferProtocol", "ascend"),
    (
        {"engine": {"device": "cuda", "transferProtocol": "ascend"}},
        "spec.engine.transferProtocol",
        "rdma or tcp",
    ),
    (
        {"engine": {"env": [{"name": "POD_IP", "value": "x"}]}},
        "spec.engine.env[0].name",
        "set by the operator",
    ),
    ({"engine": {"env": [{"name": "A"}, {"name": "A"}]}}, "spec.engine.env[1].name", "duplicate"),
    ({"prefill": {"npusPerPod": 32, "tensorParallelSize": 32}}, "spec.prefill.npusPerPod", "multi-node"),
    ({"decode": {"tensorParallelSize": 16}}, "spec.decode.tensorParallelSize", "multi-node"),
    ({"decode": {"tensorParallelSize": 4}}, "spec.decode.npusPerPod", "idle"),
    ({"decode": {"npusPerPod": 0}}, "spec.decode.npusPerPod", "at least 1"),
    ({"decode": {"expertParallelSize": 3}}, "spec.decode.expertParallelSize", "divide"),
    (
        {"prefill": {"resources": {"requests": {"huawei.com/Ascend910": 8}}}},
        "spec.prefill.resources.requests",
        "npusPerPod",
    ),
    ({"decode": {"replicas": 0}}, "spec.decode.replicas", "both be 0"),
    ({"router": {"port": 29000}}, "spec.router.metricsPort", "differ"),
    ({"router": {"decodePolicy": "bucket"}}, "spec.router.decodePolicy", "Input should be"),
    ({"service": {"nodePort": 30080}}, "spec.service.nodePort", "NodePort or LoadBalancer"),
    ({"podAnnotations": {"sglang.ai/bootstrap-port": "1"}}, "spec.podAnnotations", "bootstrapPort"),
    ({"apiKeySecret": {"name": "Bad_Name"}}, "spec.apiKeySecret.name", "pattern"),
    ({"model": {"hostPath": {"path": "/a/../b"}}}, "spec.model.hostPath.path", "'..'"),
    ({"model": {}}, "spec.model", "exactly one"),
    (
        {"prefill": {"tolerations": [{"operator": "Equal", "value": "x"}]}},
        "spec.prefill.tolerations[0].operator",
        "Exists",
    ),
    ({"decode": {"sharedMemorySize": "1 GB"}}, "spec.decode.sharedMemorySize", "quantity"),
]


@pytest.mark.parametrize(("sections", "field", "words"), RULES, ids=[r[1] + ":" + r[2] for r in RULES])
def test_each_rule_names_field_and_reason(
    with_spec: Make, sections: dict[str, Any], field: str, words: str
) -> None:
    errors = errors_of(with_spec(**sections))
    reasons = [reason for path, reason in errors if path == field]
    assert reasons, f"no error at {field}: {errors}"
    assert any(words in r for r in reasons), reasons


def test_cpu_device_accepts_zero_npus_and_tcp(with_spec: Make) -> None:
    cpu_role = {"npusPerPod": 0, "tensorParallelSize": 2}
    dep = parse(
        with_spec(engine={"device": "cpu", "transferProtocol": "tcp"}, prefill=cpu_role, decode=cpu_role)
    )
    assert dep.spec.decode.npus_per_pod == 0


def test_paused_deployment_is_valid(with_spec: Make) -> None:
    dep = parse(with_spec(prefill={"replicas": 0}, decode={"replicas": 0}))
    assert (dep.spec.prefill.replicas, dep.spec.decode.replicas) == (0, 0)


def test_quantities_keep_their_form(with_spec: Make) -> None:
    dep = parse(with_spec(decode={"resources": {"requests": {"cpu": 4, "memory": "64Gi"}}}))
    assert dep.spec.decode.resources is not None
    assert dep.spec.decode.resources.requests == {"cpu": 4, "memory": "64Gi"}


def test_metadata_passes_server_fields_through(minimal: dict[str, Any]) -> None:
    minimal["metadata"] |= {"uid": "abc", "resourceVersion": "7", "generation": 3}
    minimal["status"] = {"observedGeneration": 2}
    assert parse(minimal).metadata.name == "dsv4"
