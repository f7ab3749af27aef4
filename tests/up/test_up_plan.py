"""`dsv4 up` runs the pods' command lines: the same engine and router arguments as the rendered
containers, except exactly the values `dsv4_operator.local` names (host, ports, discovery, model path,
API key). Pure: nothing is started."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsv4_operator import local as lc
from dsv4_operator import up
from dsv4_operator.manifests import render
from dsv4_operator.plan import ASCEND_SERVE_COMMAND, ROUTER_COMMAND, SERVE_COMMAND, plan
from dsv4_operator.spec import Dsv4Deployment, parse

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# The flags whose values differ locally, each replaced by a placeholder before comparing.
SERVER_LOCAL = {"--host", "--port", "--bootstrap-port", "--metrics-port", "--model", "--prefix-cache-peers"}
ROUTER_LOCAL = {"--host", "--port", "--prometheus-host", "--prometheus-port", "--tokenizer-path", "--api-key"}
POD_DISCOVERY = {
    "--service-discovery",
    "--service-discovery-namespace",
    "--service-discovery-port",
    "--prefill-selector",
    "--decode-selector",
}
LOCAL_DISCOVERY = {"--prefill", "--decode"}


def load(path: Path, replicas: tuple[int, int] | None = None, **spec: Any) -> Dsv4Deployment:
    """The example at `path` with `spec` fields replaced and (prefill, decode) replicas set."""
    doc = yaml.safe_load(path.read_text())
    doc["spec"].update(spec)
    for role, n in zip(("prefill", "decode"), replicas or (), strict=False):
        doc["spec"].setdefault(role, {})["replicas"] = n
    return parse(doc)


def groups(args: list[str]) -> list[list[str]]:
    """[flag, values...] per flag, in order."""
    out: list[list[str]] = []
    for arg in args:
        if arg.startswith("--"):
            out.append([arg])
        else:
            out[-1].append(arg)
    return out


def normalise(args: list[str], local_flags: set[str], discovery: set[str] = frozenset()) -> list[list[str]]:
    out: list[list[str]] = []
    for flag, *values in groups(args):
        if flag in discovery:
            if ["<discovery>"] not in out:
                out.append(["<discovery>"])
        elif flag in local_flags:
            out.append([flag, f"<{flag}>"] if values else [flag])
        else:
            out.append([flag, *values])
    return out


def container(objs: list[dict[str, Any]], kind: str, role: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["labels"].get("dsv4.ai/role") == role]
    return obj["spec"]["template"]["spec"]["containers"][0]


def local_for(dep: Dsv4Deployment, cpus: list[int] | None = None) -> lc.Local:
    ports = {name: 40000 + i for i, name in enumerate(lc.port_slots(dep))}
    return lc.local(dep, model="/here/model", ports=ports, cpus=cpus or [0, 1], env={lc.API_KEY_ENV: "k"})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("api_key", [False, True], ids=["no-key", "key"])
def test_local_processes_get_the_pods_arguments(path: Path, api_key: bool) -> None:
    extra = {"apiKeySecret": {"name": "dsv4-key"}} if api_key else {}
    dep = load(path, replicas=(2, 3), **extra)
    objs = render(dep)
    lo = local_for(dep)
    assert [s.name for s in lo.servers] == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    for server in lo.servers:
        pod = container(objs, "StatefulSet", server.role)
        # On NPU the pod starts through dsv4-ascend (CANN's environment first); locally, dsv4 itself.
        assert pod["command"] == list(
            ASCEND_SERVE_COMMAND if dep.spec.engine.device == "npu" else SERVE_COMMAND
        )
        argv = lc.server_argv(dep, lo, server)
        assert argv[: len(lc.serve_command())] == lc.serve_command()
        mine = argv[len(lc.serve_command()) :]
        assert normalise(mine, SERVER_LOCAL) == normalise(pod["args"], SERVER_LOCAL)
        values = dict((g[0], g[1:]) for g in groups(mine))
        assert values["--host"] == [lc.HOST] and values["--model"] == ["/here/model"]
        assert values["--port"] == [str(server.port)]
        if server.role == "prefill" and dep.spec.engine.prefix_cache:  # pods: the role's headless Service
            want = ",".join(lo.url(s.port) for s in lo.role("prefill"))
            assert values["--prefix-cache-peers"] == [want]
            rp = plan(dep).prefill
            assert dict((g[0], g[1:]) for g in groups(pod["args"]))["--prefix-cache-peers"] == [
                f"http://{rp.name}:{dep.spec.engine.port}"
            ]
        else:
            assert "--prefix-cache-peers" not in values
        assert values["--metrics-port"] == [str(server.metrics_port)] != values["--port"]
    pod = container(objs, "Deployment", "router")
    assert pod["command"] == list(ROUTER_COMMAND)
    argv = lc.router_argv(dep, lo)
    assert argv[: len(lc.router_command())] == lc.router_command()
    mine = argv[len(lc.router_command()) :]
    assert normalise(mine, ROUTER_LOCAL, LOCAL_DISCOVERY) == normalise(
        pod["args"], ROUTER_LOCAL, POD_DISCOVERY
    )
    values = groups(mine)
    assert [g for g in values if g[0] in LOCAL_DISCOVERY] == [
        *(["--prefill", f"http://127.0.0.1:{s.port}", str(s.bootstrap_port)] for s in lo.role("prefill")),
        *(["--decode", f"http://127.0.0.1:{s.port}"] for s in lo.role("decode")),
    ]
    assert (["--api-key", "k"] in values) == (dep.spec.api_key_secret is not None)
    assert ["--tokenizer-path", "/here/model"] in values


def test_the_local_router_command_line_is_accepted_by_sglang_router() -> None:
    from sglang_router.launch_router import parse_router_args
    from sglang_router.router import Router

    dep = load(ROOT / "examples" / "cpu-tiny.yaml")
    lo = local_for(dep)
    ra = parse_router_args(lc.router_argv(dep, lo)[len(lc.router_command()) :])
    assert ra.pd_disaggregation and not ra.service_discovery
    assert ra.host == "127.0.0.1" and ra.port == lo.router_port
    Router.from_args(ra)  # the Rust side accepts it (nothing is started)


def test_ports_follow_the_spec_offset_per_server() -> None:
    dep = load(ROOT / "examples" / "cpu-tiny.yaml", replicas=(2, 2))
    slots = {name: port for name, (port, _) in lc.port_slots(dep).items()}
    assert slots == {
        "prefill-0": 30000, "prefill-1": 30001, "decode-0": 30002, "decode-1": 30003,
        "prefill-0.metrics": 29100, "prefill-1.metrics": 29101,
        "decode-0.metrics": 29102, "decode-1.metrics": 29103,
        "prefill-0.bootstrap": 8998, "prefill-1.bootstrap": 8999,
        "router": 8000, "router.metrics": 29000,
    }  # fmt: skip
    lo = lc.local(dep, model="/m", ports=slots, cpus=[0], env={})
    assert [s.bootstrap_port for s in lo.servers] == [8998, 8999, 8998, 8998]  # decode: the first prefill's
    assert [s.metrics_port for s in lo.servers] == [29100, 29101, 29102, 29103]
    free = lc.free_ports(dep)
    assert free.keys() == slots.keys() and len(set(free.values())) == len(free)


def test_a_port_in_use_names_its_field() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        dep = load(ROOT / "examples" / "cpu-tiny.yaml", router={"port": busy})
        with pytest.raises(lc.LocalError) as exc:
            lc.spec_ports(dep)
    assert exc.value.errors[0][0] == "spec.router.port"
    assert "--ports free" in exc.value.errors[0][1]


@pytest.mark.parametrize(
    ("cpus", "prefill", "decode", "want"),
    [
        ([0], 1, 1, {"prefill-0": (0,), "decode-0": (0,)}),
        ([0, 1], 1, 1, {"prefill-0": (0,), "decode-0": (1,)}),
        ([0, 1, 2], 1, 1, {"prefill-0": (0, 1), "decode-0": (2,)}),
        ([4, 5, 6, 7], 2, 1, {"prefill-0": (4,), "prefill-1": (5,), "decode-0": (6, 7)}),
        ([0, 1, 2, 3], 1, 3, {"prefill-0": (0, 1), "decode-0": (2,), "decode-1": (3,), "decode-2": (2,)}),
        (list(range(16)), 2, 1, {"prefill-0": (0, 1, 2, 3), "prefill-1": (4, 5, 6, 7), "decode-0": tuple(range(8, 16))}),
    ],
)  # fmt: skip
def test_cores_split_between_the_roles(cpus: list[int], prefill: int, decode: int, want: dict) -> None:
    assert lc.split_cpus(cpus, prefill, decode) == want


def test_each_server_gets_its_cores_role_and_the_specs_env() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "cpu-tiny.yaml").read_text())
    doc["spec"]["engine"]["env"] = [{"name": "MC_TCP_LANES_PER_PEER", "value": "4"}]
    dep = parse(doc)
    lo = local_for(dep, cpus=[2, 3, 4])
    base = {"PATH": "/bin", lc.API_KEY_ENV: "k", "NO_PROXY": "corp"}
    prefill, decode = lo.servers
    env = lc.server_env(dep, prefill, base)
    assert env["OMP_NUM_THREADS"] == "2" and env["DSV4_ROLE"] == "prefill"
    assert env["MC_TCP_LANES_PER_PEER"] == "4" and env["PATH"] == "/bin"
    assert lc.API_KEY_ENV not in env  # enforced at the router only, as in the pods
    assert env["NO_PROXY"] == "corp,127.0.0.1,localhost"
    assert lc.server_env(dep, decode, base)["OMP_NUM_THREADS"] == "1"
    assert lo.cpus == (2, 3, 4)


def test_an_api_key_secret_needs_the_key_in_the_environment() -> None:
    dep = load(ROOT / "examples" / "cpu-tiny.yaml", apiKeySecret={"name": "dsv4-key"})
    with pytest.raises(lc.LocalError) as exc:
        lc.local(dep, model="/m", ports=lc.free_ports(dep), cpus=[0], env={})
    assert exc.value.errors[0][0] == "spec.apiKeySecret"


def test_a_missing_model_names_the_field(tmp_path: Path) -> None:
    dep = load(ROOT / "examples" / "cpu-tiny.yaml", model={"hostPath": {"path": str(tmp_path / "none")}})
    with pytest.raises(lc.LocalError) as exc:
        up.resolve_model(dep)
    assert exc.value.errors[0][0] == "spec.model.hostPath.path"
    dep = load(ROOT / "examples" / "cpu-tiny.yaml", model={"image": {"path": "/opt/elsewhere"}})
    with pytest.raises(lc.LocalError) as exc:
        up.resolve_model(dep)
    assert exc.value.errors[0][0] == "spec.model.image.path"


def test_the_bundled_example_serves_the_bundled_demo_checkpoint_without_torch() -> None:
    code = (
        "import sys; from dsv4_operator import up; from dsv4_engine import demo; "
        "assert up.resolve_model(up.load(up.BUNDLED_SPEC)) == str(demo.BUNDLED); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_damaged_demo_checkpoint_is_an_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsv4_engine import demo

    copy = Path(shutil.copytree(demo.BUNDLED, tmp_path / "demo"))
    (copy / "generation_config.json").write_text("{}")
    monkeypatch.setattr(demo, "BUNDLED", copy)
    with pytest.raises(lc.LocalError) as e:
        up.resolve_model(up.load(up.BUNDLED_SPEC))
    assert "generation_config.json differ" in str(e.value)


def test_the_bundled_spec_is_the_cpu_example() -> None:
    assert up.BUNDLED_SPEC.read_bytes() == (ROOT / "examples" / "cpu-tiny.yaml").read_bytes()


def test_an_invalid_spec_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "cpu-tiny.yaml").read_text())
    doc["spec"]["engine"]["pageSize"] = 100
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert up.main(["-f", str(path)]) == 2
    assert f"{path}: spec.engine.pageSize:" in capsys.readouterr().err


def test_up_imports_no_torch() -> None:
    code = "import sys, dsv4_operator.cli, dsv4_operator.up; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_prefix_cache_volume_is_a_directory_named_after_its_claim(tmp_path: Path) -> None:
    """engine.prefixCacheVolume: where prefill pods mount the claim, the local prefill servers get
    <claims>/<claim name>/<path> as --prefix-cache-dir (the same for every replica, as the claim is);
    the decode servers get none; with no directory for claims the spec is refused by field."""
    vol = {"claimName": "chat-cache", "path": "v4", "saveIntervalSeconds": 60}
    base = yaml.safe_load((ROOT / "examples" / "cpu-tiny.yaml").read_text())
    base["spec"]["engine"]["prefixCacheVolume"] = vol
    base["spec"]["prefill"]["replicas"] = 2
    dep = parse(base)
    ports = {name: 40000 + i for i, name in enumerate(lc.port_slots(dep))}
    lo = lc.local(dep, model="/here/model", ports=ports, cpus=[0, 1], env={}, claims=tmp_path)
    pods = render(dep)
    for server in lo.servers:
        values = dict(
            (g[0], g[1:]) for g in groups(lc.server_argv(dep, lo, server)[len(lc.serve_command()) :])
        )
        pod = dict((g[0], g[1:]) for g in groups(container(pods, "StatefulSet", server.role)["args"]))
        if server.role == "decode":
            assert "--prefix-cache-dir" not in values
            continue
        assert values["--prefix-cache-dir"] == [str(tmp_path / "chat-cache" / "v4")]
        assert values["--prefix-cache-save-interval"] == pod["--prefix-cache-save-interval"] == ["60"]
    with pytest.raises(lc.LocalError, match="no directory"):
        lc.local(dep, model="/here/model", ports=ports, cpus=[0, 1], env={})
