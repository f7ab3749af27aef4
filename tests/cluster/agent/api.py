"""The few API calls a kubelet makes, over httpx with the kubeconfig's server and bearer token."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx
import yaml

Obj = dict[str, Any]


class Api:
    def __init__(self, kubeconfig: str) -> None:
        with open(kubeconfig) as f:
            cfg = yaml.safe_load(f)
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == cfg["current-context"])
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        self.http = httpx.Client(
            base_url=cluster["server"],
            headers={"Authorization": f"Bearer {user['token']}"},
            verify=not cluster.get("insecure-skip-tls-verify"),
            timeout=30,
        )

    def _call(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Obj:
        content = None if body is None else json.dumps(body)
        resp = self.http.request(method, path, content=content, headers={"Content-Type": ctype})
        if resp.status_code == 404:
            raise KeyError(path)
        if resp.status_code == 409 and method == "POST":
            raise FileExistsError(path)
        resp.raise_for_status()
        return resp.json()

    def get(self, path: str) -> Obj:
        return self._call("GET", path)

    def create(self, path: str, body: Obj) -> Obj:
        return self._call("POST", path, body)

    def merge_patch(self, path: str, body: Obj) -> Obj:
        return self._call("PATCH", path, body, "application/merge-patch+json")

    def delete(self, path: str, body: Obj | None = None) -> None:
        with contextlib.suppress(KeyError):  # already gone
            self._call("DELETE", path, body)

    def pods(self) -> list[Obj]:
        return self.get("/api/v1/pods")["items"]

    def pod_path(self, pod: Obj, sub: str = "") -> str:
        meta = pod["metadata"]
        return f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}{sub}"
