"""`dsv4 render` as a user runs it, and the promise that neither it nor `dsv4 operator` imports torch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsv4_operator.manifests import render
from dsv4_operator.render import dump
from dsv4_operator.spec import SpecError, parse
from suite import skips

ROOT = Path(__file__).resolve().parents[2]
VALID = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))
# The console script when installed, else the same entry point through the interpreter.
DSV4 = Path(sys.executable).parent / "dsv4"
HEAVY = ("torch", "transformers", "dsv4_engine")


def dsv4(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [str(DSV4)] if DSV4.exists() else [sys.executable, "-m", "dsv4_operator.cli"]
    return subprocess.run([*cmd, *argv], input=stdin, capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_render_prints_every_object_of_every_example(path: Path) -> None:
    result = dsv4("render", "-f", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    expected = render(parse(yaml.safe_load(path.read_text())))
    assert list(yaml.safe_load_all(result.stdout)) == expected
    assert result.stdout == dump(expected)  # byte-identical to an in-process render


def test_render_is_byte_identical_run_to_run() -> None:
    path = str(ROOT / "examples" / "production.yaml")
    assert dsv4("render", "-f", path).stdout == dsv4("render", "-f", path).stdout


def test_render_reads_stdin_and_takes_namespace() -> None:
    text = (ROOT / "examples" / "minimal.yaml").read_text()
    result = dsv4("render", "-f", "-", "--namespace", "team-a", stdin=text)
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert {d["metadata"]["namespace"] for d in docs} == {"team-a"}
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["subjects"][0]["namespace"] == "team-a"


def test_render_fingerprint_only() -> None:
    path = ROOT / "examples" / "minimal.yaml"
    from dsv4_operator.fingerprint import deployment_fingerprint

    result = dsv4("render", "-f", str(path), "--fingerprint")
    assert result.returncode == 0
    assert result.stdout == f"dsv4 {deployment_fingerprint(parse(yaml.safe_load(path.read_text())))}\n"


@pytest.mark.parametrize("path", INVALID[::16], ids=lambda p: p.name)
def test_bad_spec_exits_2_with_each_field_error(path: Path) -> None:
    result = dsv4("render", "-f", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    with pytest.raises(SpecError) as info:
        parse(yaml.safe_load(path.read_text()))
    lines = result.stderr.strip().splitlines()
    assert lines == [f"{path}: {field}: {reason}" for field, reason in info.value.errors]


def test_several_errors_each_on_its_own_line(tmp_path: Path) -> None:
    obj = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    obj["spec"]["engine"] = {"pageSize": 256, "chunkedPrefillSize": 8320, "bootstrapPort": 30000}
    obj["spec"]["decode"] = {"expertParallelSize": 3}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(obj))
    result = dsv4("render", "-f", str(bad))
    assert result.returncode == 2
    fields = [line.split(": ")[1] for line in result.stderr.strip().splitlines()]
    assert fields == [
        "spec.engine.chunkedPrefillSize",
        "spec.engine.bootstrapPort",
        "spec.decode.expertParallelSize",
    ]


def test_missing_file_and_no_arguments(tmp_path: Path) -> None:
    result = dsv4("render", "-f", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "nope.yaml" in result.stderr
    assert dsv4("render").returncode == 2
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert dsv4("render", "-f", str(empty)).returncode == 2


def heavy_modules_after(code: str) -> list[str]:
    """Run `code` in a fresh interpreter; return the heavy modules it left in sys.modules."""
    probe = f"{code}\nimport sys\nprint('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("HEAVY="), result.stderr
    return [m for m in line.removeprefix("HEAVY=").split(",") if m]


def test_dsv4_render_never_imports_torch() -> None:
    path = ROOT / "examples" / "production.yaml"
    code = f"from dsv4_operator.cli import main\nassert main(['render', '-f', {str(path)!r}]) == 0"
    assert heavy_modules_after(code) == []
    assert (
        heavy_modules_after("from dsv4_operator.cli import main\nassert main(['render', '--crd']) == 0") == []
    )


def test_the_probe_detects_torch() -> None:
    # The check above could pass vacuously; show it sees torch when torch is imported.
    if importlib.util.find_spec("torch") is None:
        skips.missing("torch not installed here (the engine extra installs it)")
    assert "torch" in heavy_modules_after("import torch")


def test_dsv4_operator_never_imports_torch() -> None:
    # Import the command's module and resolve its entry point, as `dsv4 operator` does before running.
    code = "import importlib\nm = importlib.import_module('dsv4_operator.run')\nassert callable(m.main)"
    assert heavy_modules_after(code) == []


def test_kube_version_1_20_uses_policy_v1beta1() -> None:
    path = str(ROOT / "examples" / "minimal.yaml")
    old = list(yaml.safe_load_all(dsv4("render", "-f", path, "--kube-version", "1.20").stdout))
    new = list(yaml.safe_load_all(dsv4("render", "-f", path, "--kube-version", "1.30").stdout))
    assert {d["apiVersion"] for d in old if d["kind"] == "PodDisruptionBudget"} == {"policy/v1beta1"}
    assert {d["apiVersion"] for d in new if d["kind"] == "PodDisruptionBudget"} == {"policy/v1"}
    # Nothing else differs.
    strip = [{k: v for k, v in d.items() if k != "apiVersion"} for d in old]
    assert strip == [{k: v for k, v in d.items() if k != "apiVersion"} for d in new]
    assert dsv4("render", "-f", path, "--kube-version", "two").returncode == 2
