"""The images this agent knows, as what a container of each would be on this machine: the venv's
console scripts first on PATH (the Dockerfile installs the same distribution), the image's ENV and
ENTRYPOINT, and paths the image bakes in (tiny checkpoints at /opt/dsv4/models/NAME) mapped to
local directories. Any other image fails to start with ErrImageNeverPull, as `Never` would."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Image:
    entrypoint: tuple[str, ...]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # path in the image -> local path
    caches: dict[str, str] = field(default_factory=dict)  # the same, writable and shared


def _base_env() -> dict[str, str]:
    venv_bin = os.path.dirname(sys.executable)
    return {
        "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
    }


def kernel_cache() -> str:
    """This machine's build cache of the engine's CPU kernels (dsv4_engine.kernels.cache_dir)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    path = os.path.join(base, "dsv4", "kernels")
    os.makedirs(path, exist_ok=True)
    return path


RELEASE = "/opt/dsv4/release"  # where an earlier operator release's differences sit in its image


def known_images(models: dict[str, str], operator_releases: dict[str, str] | None = None) -> dict[str, Image]:
    """Keyed by repository basename (the part after the last '/', before the tag), or basename:tag
    for a tag that differs. `models`: the checkpoints engine-cpu bakes in, by name, at
    /opt/dsv4/models/NAME. `operator_releases`: tag -> a folder holding an earlier operator release's
    differences from this one (`site/`, first on PYTHONPATH: its dist-info, so the operator reports
    that version; `crd.yaml`: the CRD that release bundled), for `dsv4-operator:TAG`."""
    engine_env = _base_env() | {
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        # Several pods share two cores: one intra-op thread each, as a CPU limit of 1 would give.
        "OMP_NUM_THREADS": "1",
        "XDG_CACHE_HOME": "/opt/dsv4/cache",
    }
    # The kernels built once, as an image would ship them: a cold build in every pod (HOME is its
    # emptyDir) takes minutes on two loaded cores. Keyed by a hash of their sources, so shared safely.
    caches = {"/opt/dsv4/cache/dsv4/kernels": kernel_cache()}
    return {
        "engine-cpu": Image(
            ("dsv4",), engine_env, {f"/opt/dsv4/models/{n}": d for n, d in models.items()}, caches
        ),
        "dsv4-operator": Image(("dsv4", "operator"), _base_env()),
    } | {
        f"dsv4-operator:{tag}": Image(
            ("dsv4", "operator"),
            _base_env() | {"PYTHONPATH": f"{RELEASE}/site", "DSV4_CRD_PATH": f"{RELEASE}/crd.yaml"},
            {RELEASE: d},
        )
        for tag, d in (operator_releases or {}).items()
    }


def lookup(images: dict[str, Image], ref: str) -> Image | None:
    name = ref.rsplit("/", 1)[-1].split("@", 1)[0]
    return images.get(name) or images.get(name.split(":", 1)[0])
