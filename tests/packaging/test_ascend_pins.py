"""The engine-ascend image's packages resolve, without building the image: what the `ascend` extra pins
on top of the engine (torch, torch_npu, Mooncake's Ascend build), with everything they require, as pip
would install them in that image (CPython 3.11 on the CANN base's glibc 2.35), for both architectures
Ascend hosts use. A pin that does not exist, has no wheel for the platform, or contradicts another
(torch_npu pins an exact torch) fails here, not in a user's `docker build`. pip reads only the index
and the wheels' metadata, both architectures at once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
GLIBC = 35  # Ubuntu 22.04, the CANN images' base
PYTHON = "3.11"


def requirements(extra: str) -> list[str]:
    """The extra's requirements with the project's own extras (`dsv4[...]`) expanded."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out: list[str] = []
    for req in extras[extra]:
        m = re.fullmatch(r"dsv4\[([\w,-]+)\]", req)
        out += [r for e in m.group(1).split(",") for r in requirements(e)] if m else [req]
    return out


def stage(name: str) -> str:
    text = (ROOT / "Dockerfile").read_text()
    return re.split(r"^FROM ", text.split(f" AS {name}\n", 1)[1], flags=re.M)[0]


def build_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M))


def test_the_image_installs_the_ascend_extra_with_the_pins_it_declares() -> None:
    body, args = stage("engine-ascend"), build_args()
    assert '".[ascend]"' in body
    pins = dict(r.split("==") for r in requirements("ascend") if "==" in r)
    # What the build args add on the same pip line must be what the extra pins.
    assert pins["torch"] == args["TORCH_VERSION"] and pins["torch-npu"] == args["TORCH_NPU_VERSION"]
    assert "mooncake-transfer-engine-npu" in pins
    assert not any(r.startswith("mooncake-transfer-engine-non-cuda") for r in requirements("ascend"))


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_ascend_pins_resolve_for_both_architectures(tmp_path: Path) -> None:
    """Each pin has a wheel for the image's platform, and what each requires of another pinned
    package (torch_npu of torch) holds for the pinned versions."""
    pinned = [r for r in requirements("ascend") if r not in requirements("engine-core")]
    pins = {_name(n): Version(v) for n, v in (r.split("==") for r in pinned)}
    assert set(pins) == {"torch", "torch-npu", "mooncake-transfer-engine-npu"}
    runs = {}
    for arch in ("aarch64", "x86_64"):
        platforms = [f"manylinux_2_{n}_{arch}" for n in range(GLIBC, 16, -1)] + [f"manylinux2014_{arch}"]
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--no-deps",
               "--only-binary=:all:", "--implementation", "cp", "--python-version", PYTHON,
               *(f"--platform={p}" for p in platforms), "--target", str(tmp_path / arch),
               "--report", str(tmp_path / f"{arch}.json"), *pinned]  # fmt: skip
        runs[arch] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for arch, proc in runs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (arch, err[-3000:])
        report = json.loads((tmp_path / f"{arch}.json").read_text())["install"]
        got = {_name(i["metadata"]["name"]): i["metadata"] for i in report}
        assert {n: Version(got[n]["version"]) for n in pins} == pins, arch
        for name, meta in got.items():
            for req in map(Requirement, meta.get("requires_dist") or []):
                if _name(req.name) in pins and (req.marker is None or req.marker.evaluate({"extra": ""})):
                    assert pins[_name(req.name)] in req.specifier, (arch, name, str(req))
