"""The deployment fingerprint changes exactly when what prefill and decode exchange changes."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from dsv4_operator.fingerprint import deployment_fingerprint
from dsv4_operator.spec import parse

Make = Callable[..., dict[str, Any]]

ALTERS = {
    "image": {"image": "registry.example.com/dsv4/engine-ascend:0.1.1"},
    "model path": {"model": {"pvc": {"claimName": "deepseek-v4-weights", "path": "DeepSeek-V4-0424"}}},
    "model claim": {"model": {"pvc": {"claimName": "other-weights", "path": "DeepSeek-V4"}}},
    "model source kind": {"model": {"hostPath": {"path": "/models/DeepSeek-V4"}}},
    "model revision": {
        "model": {"pvc": {"claimName": "deepseek-v4-weights", "path": "DeepSeek-V4"}, "revision": "r2"}
    },
    "dtype": {"engine": {"dtype": "bfloat16"}},
    "page size": {"engine": {"pageSize": 256}},
    "prefill tp": {"prefill": {"tensorParallelSize": 4, "npusPerPod": 4}},
    "decode tp": {"decode": {"tensorParallelSize": 16, "npusPerPod": 16}},
    "prefill ep": {"prefill": {"expertParallelSize": 8}},
    "decode ep": {"decode": {"expertParallelSize": 2}},
    "device and transport": {
        "engine": {"device": "cuda", "transferProtocol": "rdma"},
    },
}
KEEPS = {
    "replicas": {"prefill": {"replicas": 3}, "decode": {"replicas": 5}},
    "router replicas and policies": {
        "router": {"replicas": 3, "prefillPolicy": "random", "decodePolicy": "cache_aware"}
    },
    "resources": {"decode": {"resources": {"requests": {"cpu": "8", "memory": "64Gi"}}}},
    "node selector and tolerations": {
        "prefill": {
            "nodeSelector": {"pool": "npu"},
            "tolerations": [{"key": "npu", "operator": "Exists", "effect": "NoSchedule"}],
        }
    },
    "affinity and priority": {"decode": {"affinity": {"nodeAffinity": {}}, "priorityClassName": "high"}},
    "npu resource name": {"prefill": {"npuResourceName": "huawei.com/ascend-1980"}},
    "shared memory": {"decode": {"sharedMemorySize": "64Gi"}},
    "service": {"service": {"type": "NodePort", "port": 80, "nodePort": 30080}},
    "api key": {"apiKeySecret": {"name": "dsv4-key"}},
    "engine limits": {
        "engine": {"maxModelLen": 65536, "chunkedPrefillSize": 4096, "maxNumSeqs": 64, "maxWaiting": 8}
    },
    "ports": {"engine": {"port": 31000, "bootstrapPort": 9000}},
    "grace period and env": {
        "engine": {"gracePeriodSeconds": 300, "env": [{"name": "HCCL_BUFFSIZE", "value": "1"}]}
    },
    "ascend host settings": {"ascend": {"hcclSocketIfname": "enp1", "mountDriver": False}},
    "probes and rollout": {"probes": {"startupTimeoutSeconds": 7200}, "rollout": {"drainSeconds": 10}},
    "security": {"podSecurity": {"runAsUser": 2000}},
    "network policy and annotations": {"networkPolicy": {"enabled": False}, "podAnnotations": {"a": "b"}},
    "served model name": {
        "model": {
            "pvc": {"claimName": "deepseek-v4-weights", "path": "DeepSeek-V4"},
            "servedModelName": "dsv4",
        }
    },
}


def fp(obj: dict[str, Any]) -> str:
    return deployment_fingerprint(parse(obj))


def test_fingerprint_shape_and_stability(minimal: dict[str, Any]) -> None:
    first = fp(minimal)
    assert re.fullmatch(r"[0-9a-f]{10}", first)
    assert fp(minimal) == first


def test_fingerprint_ignores_identity(minimal: dict[str, Any]) -> None:
    before = fp(minimal)
    minimal["metadata"] = {"name": "other", "namespace": "elsewhere", "uid": "x"}
    assert fp(minimal) == before


@pytest.mark.parametrize("change", ALTERS, ids=list(ALTERS))
def test_change_alters_fingerprint(with_spec: Make, minimal: dict[str, Any], change: str) -> None:
    assert fp(with_spec(**ALTERS[change])) != fp(minimal)


@pytest.mark.parametrize("change", KEEPS, ids=list(KEEPS))
def test_change_keeps_fingerprint(with_spec: Make, minimal: dict[str, Any], change: str) -> None:
    assert fp(with_spec(**KEEPS[change])) == fp(minimal)


def test_default_written_out_is_the_same_fingerprint(with_spec: Make, minimal: dict[str, Any]) -> None:
    explicit = with_spec(engine={"dtype": "auto", "pageSize": 128}, decode={"tensorParallelSize": 8})
    assert fp(explicit) == fp(minimal)
