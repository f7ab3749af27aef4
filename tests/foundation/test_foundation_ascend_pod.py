"""The server pod the operator renders for Ascend, field by field, against what an NPU server needs
(docs/npu.md, "The pod"): the device plugin's resource, the driver and its tools from the node, the
NPU NIC addresses (hccn.conf), HCCL's host-side addresses, the driver's group, CANN's environment,
the node network when asked, and no device visibility of its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsv4_operator.manifests import render
from dsv4_operator.spec import SpecError, parse

ROOT = Path(__file__).resolve().parents[2]
Make = Callable[..., dict[str, Any]]
DRIVER_TOOLS = {
    "ascend-driver": ("/usr/local/Ascend/driver", "Directory"),
    "ascend-dcmi": ("/usr/local/dcmi", "Directory"),
    "npu-smi": ("/usr/local/bin/npu-smi", "File"),
    "ascend-install-info": ("/etc/ascend_install.info", "File"),
}


def server_pods(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """role -> the pod template of its StatefulSet."""
    sts = [o for o in render(parse(obj)) if o["kind"] == "StatefulSet"]
    return {o["spec"]["template"]["metadata"]["labels"]["dsv4.ai/role"]: o["spec"]["template"] for o in sts}


def host_mounts(pod: dict[str, Any]) -> dict[str, tuple[str, str, str, bool]]:
    """volume name -> (node path, hostPath type, mount path, read-only) for every hostPath volume."""
    c = pod["spec"]["containers"][0]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    return {
        v["name"]: (v["hostPath"]["path"], v["hostPath"]["type"], mounts[v["name"]]["mountPath"],
                    mounts[v["name"]].get("readOnly", False))
        for v in pod["spec"]["volumes"] if "hostPath" in v and v["name"] != "model"
    }  # fmt: skip


def env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def test_the_default_ascend_pod(minimal: dict[str, Any]) -> None:
    for role, pod in server_pods(minimal).items():
        spec, c = pod["spec"], pod["spec"]["containers"][0]
        # CANN's set_env.sh runs before Python: the image's entrypoint, named explicitly.
        assert c["command"] == ["dsv4-ascend", "serve"], role
        # The device plugin's extended resource, requests equal to limits; nothing else asks for NPUs.
        assert c["resources"] == {
            "limits": {"huawei.com/Ascend910": "8"},
            "requests": {"huawei.com/Ascend910": "8"},
        }
        # The driver, its tools and hccn.conf from the node, read-only, at the paths CANN looks in.
        want = {name: (path, kind, path, True) for name, (path, kind) in DRIVER_TOOLS.items()}
        want["hccn-conf"] = ("/etc/hccn.conf", "File", "/etc/hccn.conf", True)
        assert host_mounts(pod) == want
        # HCCL's host-side sockets: the pod IP on the pod's interface.
        e = env(pod)
        assert e["HCCL_IF_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert e["HCCL_SOCKET_IFNAME"] == "eth0"
        # Which NPUs the pod sees is the device plugin's business (ASCEND_VISIBLE_DEVICES): not set here.
        assert not {"ASCEND_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"} & set(e)
        # Non-root, in the driver's group (HwHiAiUser, 1000 by default).
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["supplementalGroups"] == [1000]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        # The pod network by default: the NetworkPolicy applies and two servers may share a node.
        assert "hostNetwork" not in spec and "dnsPolicy" not in spec
        # Shared memory for the engine's host buffers, a writable /tmp for CANN's logs and caches.
        assert {v["name"] for v in spec["volumes"]} >= {"dshm", "tmp"}


def test_host_network_puts_hccl_on_the_node_nic(with_spec: Make) -> None:
    pods = server_pods(with_spec(ascend={"hostNetwork": True, "hcclSocketIfname": "enp189s0f0"}))
    for pod in pods.values():
        assert pod["spec"]["hostNetwork"] is True
        assert pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"  # cluster DNS still resolves
        e = env(pod)
        assert e["HCCL_SOCKET_IFNAME"] == "enp189s0f0"
        assert e["HCCL_IF_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # the node IP there


def test_a_runtime_that_injects_the_driver_leaves_only_hccn_conf(with_spec: Make) -> None:
    for pod in server_pods(with_spec(ascend={"mountDriver": False})).values():
        assert set(host_mounts(pod)) == {"hccn-conf"}
    for pod in server_pods(with_spec(ascend={"mountDriver": False, "mountHccnConf": False})).values():
        assert host_mounts(pod) == {}


def test_paths_and_group_follow_the_spec(with_spec: Make) -> None:
    obj = with_spec(
        ascend={"driverPath": "/opt/Ascend/driver", "hccnConfPath": "/opt/hccn.conf", "driverGroupId": 1001}
    )
    for pod in server_pods(obj).values():
        mounts = host_mounts(pod)
        assert mounts["ascend-driver"][:3] == ("/opt/Ascend/driver", "Directory", "/opt/Ascend/driver")
        assert mounts["hccn-conf"][:3] == ("/opt/hccn.conf", "File", "/opt/hccn.conf")
        assert pod["spec"]["securityContext"]["supplementalGroups"] == [1001]


def test_the_1980_example_renders_its_ascend_settings() -> None:
    obj = yaml.safe_load((ROOT / "examples" / "ascend-1980.yaml").read_text())
    for pod in server_pods(obj).values():
        assert pod["spec"]["hostNetwork"] is True
        assert pod["spec"]["securityContext"]["supplementalGroups"] == [1001]
        assert set(host_mounts(pod)) == {"hccn-conf"}
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"huawei.com/ascend-1980": "4"}


def test_other_devices_get_none_of_it(with_spec: Make) -> None:
    obj = with_spec(engine={"device": "cuda", "transferProtocol": "rdma"}, ascend={"hostNetwork": True})
    for role in ("prefill", "decode"):
        obj["spec"].setdefault(role, {})["npuResourceName"] = "nvidia.com/gpu"
    for pod in server_pods(obj).values():
        assert pod["spec"]["containers"][0]["command"] == ["dsv4", "serve"]
        assert host_mounts(pod) == {} and "hostNetwork" not in pod["spec"]
        assert "supplementalGroups" not in pod["spec"]["securityContext"]
        assert not {"HCCL_IF_IP", "HCCL_SOCKET_IFNAME"} & set(env(pod))


@pytest.mark.parametrize("name", ["ASCEND_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"])
def test_device_visibility_is_the_device_plugins(with_spec: Make, name: str) -> None:
    with pytest.raises(SpecError) as err:
        parse(with_spec(engine={"env": [{"name": name, "value": "0,1"}]}))
    assert err.value.errors == [
        (
            "spec.engine.env[0].name",
            f"{name} is set by the NPU device plugin for the NPUs allocated to the pod",
        )
    ]
