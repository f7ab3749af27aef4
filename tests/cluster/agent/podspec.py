"""A pod's container -> what runs: its argv, environment and mounts, as a kubelet derives them
(service variables, `env` with downward-API fields and $(VAR) references, `envFrom`, volumes)."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import netns
from .images import Image

Obj = dict[str, Any]
Getter = Callable[[str, str, str], Obj]  # (kind "configmaps"|"secrets", namespace, name) -> object
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodError(Exception):
    """What the pod asks for and this agent cannot give (reason, message), like CreateContainerConfigError."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) substitution: defined names expand, `$$` is a literal `$`, others stay."""
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def service_env() -> dict[str, str]:
    """The `kubernetes` Service's variables, which every container gets whatever enableServiceLinks."""
    host, port = netns.API_SERVICE_IP, "443"
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": port,
        "KUBERNETES_SERVICE_PORT_HTTPS": port,
        "KUBERNETES_PORT": f"tcp://{host}:{port}",
        "KUBERNETES_PORT_443_TCP": f"tcp://{host}:{port}",
        "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
        "KUBERNETES_PORT_443_TCP_PORT": port,
        "KUBERNETES_PORT_443_TCP_ADDR": host,
    }


def _field(pod: Obj, path: str, pod_ip: str, host_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
    }
    if path in simple:
        return simple[path]
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise PodError("CreateContainerConfigError", f"unsupported fieldRef {path}")


def _data(get: Getter, kind: str, ns: str, name: str) -> dict[str, str]:
    obj = get(kind, ns, name)
    data = dict(obj.get("data") or {})
    if kind == "secrets":
        return {k: base64.b64decode(v).decode() for k, v in data.items()}
    return data


def container_env(pod: Obj, c: Obj, image: Image, get: Getter, pod_ip: str, host_ip: str) -> dict[str, str]:
    ns = pod["metadata"]["namespace"]
    env = dict(image.env) | {"HOSTNAME": pod["metadata"]["name"]} | service_env()
    for src in c.get("envFrom") or []:
        ref = src.get("configMapRef") or src.get("secretRef")
        kind = "configmaps" if "configMapRef" in src else "secrets"
        env |= {src.get("prefix", "") + k: v for k, v in _data(get, kind, ns, ref["name"]).items()}
    for e in c.get("env") or []:
        if "value" in e or "valueFrom" not in e:
            env[e["name"]] = expand(e.get("value", ""), env)
            continue
        vf = e["valueFrom"]
        if "fieldRef" in vf:
            env[e["name"]] = _field(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
            kind = "configmaps" if "configMapKeyRef" in vf else "secrets"
            ref = vf.get("configMapKeyRef") or vf["secretKeyRef"]
            env[e["name"]] = _data(get, kind, ns, ref["name"])[ref["key"]]
        else:
            raise PodError("CreateContainerConfigError", f"unsupported valueFrom in env {e['name']}")
    return env


def argv(c: Obj, image: Image, env: dict[str, str]) -> list[str]:
    command = c.get("command") or list(image.entrypoint)
    args = c.get("args") or []
    return [expand(x, env) for x in [*command, *args]]


def volume_dirs(pod: Obj, root: Path, get: Getter) -> dict[str, str]:
    """Each volume's local directory (ConfigMaps and Secrets written out under `root`)."""
    ns, out = pod["metadata"]["namespace"], {}
    for v in pod["spec"].get("volumes") or []:
        name, d = v["name"], root / v["name"]
        if "emptyDir" in v:
            d.mkdir(parents=True, exist_ok=True)
        elif "configMap" in v or "secret" in v:
            kind = "configmaps" if "configMap" in v else "secrets"
            src = v.get("configMap") or v["secret"]
            data = _data(get, kind, ns, src.get("name") or src["secretName"])
            items = src.get("items") or [{"key": k, "path": k} for k in data]
            d.mkdir(parents=True, exist_ok=True)
            for item in items:
                (d / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                (d / item["path"]).write_text(data[item["key"]])
        elif "hostPath" in v:
            out[name] = v["hostPath"]["path"]
            continue
        else:
            raise PodError("CreateContainerConfigError", f"volume {name}: unsupported source {sorted(v)}")
        out[name] = str(d)
    return out


def mounts(c: Obj, volumes: dict[str, str], image: Image) -> list[Obj]:
    """Bind mounts, image paths first (volumes may mount over them, as in a container)."""
    out = [{"source": src, "target": dst, "readOnly": True} for dst, src in image.files.items()]
    out += [{"source": src, "target": dst, "readOnly": False} for dst, src in image.caches.items()]
    for m in c.get("volumeMounts") or []:
        src = volumes[m["name"]]
        if m.get("subPath"):
            src = os.path.join(src, m["subPath"])
        out.append({"source": src, "target": m["mountPath"], "readOnly": bool(m.get("readOnly"))})
    return out
