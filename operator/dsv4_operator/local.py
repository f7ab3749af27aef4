"""The plan realised as processes on this machine (`dsv4 up`): what differs from the pods, in one place.

The local servers and router run the argument lists that `plan.serve_args` and `plan.router_args`
build for the pods. `Local` holds the values that differ here, and nothing else differs:
- host: 127.0.0.1, where pods listen on 0.0.0.0 of their own address;
- ports: one per server (the spec's ports offset per server, or free ones), where every pod has the
  spec's ports to itself;
- discovery: `--prefill URL BOOTSTRAP_PORT --decode URL` per server, where the pods' router finds
  them by label selector;
- the model path on this machine (also the router's tokenizer path), where pods read a mount;
- the API key: the value of $DSV4_API_KEY, where pods substitute it from the Secret;
- the prefix-cache volume (engine.prefixCacheVolume): a directory of this machine named after the
  claim (`dsv4 up` puts it in its cache directory), where prefill pods mount the claim.
How the commands start differs too (this Python runs `dsv4_operator.cli serve` and sglang_router,
where the images run `dsv4` and `python3`), and CPUs are pinned here where pods get CPU requests.
"""

from __future__ import annotations

import math
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dsv4_operator.plan import model_path, router_args, serve_args
from dsv4_operator.spec import Dsv4Deployment, SpecError

HOST = "127.0.0.1"
API_KEY_ENV = "DSV4_API_KEY"
THREADS_ENV = "OMP_NUM_THREADS"  # torch sizes its intra-op pool from it
PortMode = Literal["spec", "free"]
ServerRole = Literal["prefill", "decode"]
SERVER_ROLES: tuple[ServerRole, ...] = ("prefill", "decode")


class LocalError(SpecError):
    """A valid spec that cannot run on this machine as it is; `.errors` names the field."""


@dataclass(frozen=True)
class LocalServer:
    role: ServerRole
    index: int
    port: int
    # Prefill: its bootstrap endpoint. Decode: the first prefill's, what a null bootstrap_port means
    # (pods: the spec's port, which every prefill pod has).
    bootstrap_port: int
    metrics_port: int  # its /metrics-only listener (pods: spec.monitoring.metricsPort each)
    cpus: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class Local:
    """Everything the local processes get that the pods do not (see the module docstring)."""

    host: str
    model: str
    servers: tuple[LocalServer, ...]
    router_port: int
    metrics_port: int
    api_key: str | None
    cpus: tuple[int, ...]  # all of this process's cores: the router shares them
    prefix_cache_dir: str | None = None  # the prefill servers' --prefix-cache-dir

    def url(self, port: int) -> str:
        return f"http://{self.host}:{port}"

    @property
    def endpoint(self) -> str:
        return f"{self.url(self.router_port)}/v1"

    def role(self, role: ServerRole) -> list[LocalServer]:
        return [s for s in self.servers if s.role == role]

    def discovery(self) -> list[str]:
        """The router's server list, in place of the pods' label selectors."""
        args: list[str] = []
        for s in self.role("prefill"):
            args += ["--prefill", self.url(s.port), str(s.bootstrap_port)]
        for s in self.role("decode"):
            args += ["--decode", self.url(s.port)]
        return args


def serve_command() -> list[str]:
    return [sys.executable, "-m", "dsv4_operator.cli", "serve"]


def router_command() -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router"]


def server_argv(dep: Dsv4Deployment, local: Local, server: LocalServer) -> list[str]:
    args = serve_args(
        dep,
        server.role,
        model=local.model,
        host=local.host,
        port=server.port,
        bootstrap_port=server.bootstrap_port,
        metrics_port=server.metrics_port,
        prefix_cache=local.prefix_cache_dir,
        peers=[local.url(s.port) for s in local.role("prefill")],
    )
    return [*serve_command(), *args]


def router_argv(dep: Dsv4Deployment, local: Local) -> list[str]:
    args = router_args(
        dep,
        host=local.host,
        port=local.router_port,
        metrics_port=local.metrics_port,
        tokenizer_path=local.model,
        discovery=local.discovery(),
        api_key=local.api_key,
        startup_timeout_seconds=dep.spec.probes.startup_timeout_seconds,
    )
    return [*router_command(), *args]


def server_env(dep: Dsv4Deployment, server: LocalServer, base: Mapping[str, str]) -> dict[str, str]:
    # Pods enforce the API key at the router only; a server that inherited it would refuse the router.
    env = {k: v for k, v in base.items() if k != API_KEY_ENV}
    env |= {"DSV4_ROLE": server.role, THREADS_ENV: str(len(server.cpus))}
    env["NO_PROXY"] = no_proxy(env)
    env |= {e.name: e.value or "" for e in dep.spec.engine.env or []}  # the spec's, as in the pods
    return env


def router_env(base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    env["NO_PROXY"] = no_proxy(env)
    return env


def no_proxy(env: Mapping[str, str]) -> str:
    """NO_PROXY with this host added: servers and router call each other, never through a proxy."""
    current = env.get("NO_PROXY") or env.get("no_proxy") or ""
    hosts = [h for h in current.split(",") if h]
    return ",".join([*hosts, *(h for h in (HOST, "localhost") if h not in hosts)])


# ---- ports -----------------------------------------------------------------------------------------


def port_slots(dep: Dsv4Deployment) -> dict[str, tuple[int, str]]:
    """Every local port with its spec value and the field it comes from: server i of the cluster
    (prefill first) takes engine.port + i and monitoring.metricsPort + i, prefill i takes
    bootstrapPort + i."""
    spec, eng = dep.spec, dep.spec.engine
    slots: dict[str, tuple[int, str]] = {}
    names = server_names(dep)
    for i, name in enumerate(names):
        slots[name] = (eng.port + i, f"spec.engine.port + {i} ({name})")
    metrics = spec.monitoring.metrics_port
    for i, name in enumerate(names):
        slots[f"{name}.metrics"] = (metrics + i, f"spec.monitoring.metricsPort + {i} ({name})")
    for i in range(spec.prefill.replicas):
        slots[f"prefill-{i}.bootstrap"] = (eng.bootstrap_port + i, f"spec.engine.bootstrapPort + {i}")
    slots["router"] = (spec.router.port, "spec.router.port")
    slots["router.metrics"] = (spec.router.metrics_port, "spec.router.metricsPort")
    return slots


def server_names(dep: Dsv4Deployment) -> list[str]:
    return list(_names(dep.spec.prefill.replicas, dep.spec.decode.replicas))


def spec_ports(dep: Dsv4Deployment, host: str = HOST) -> dict[str, int]:
    slots = port_slots(dep)
    problems: list[tuple[str, str]] = []
    seen: dict[int, str] = {}
    for port, origin in slots.values():
        if port > 65535:
            problems.append((origin, f"{port} is above 65535 (too many servers for this port)"))
        elif port in seen:
            problems.append((origin, f"{port} is also {seen[port]}; choose ports further apart"))
        elif not bindable(host, port):
            problems.append((origin, f"{port} is in use on {host}; free it or run `dsv4 up --ports free`"))
        seen.setdefault(port, origin)
    if problems:
        raise LocalError(problems)
    return {name: port for name, (port, _) in slots.items()}


def free_ports(dep: Dsv4Deployment, host: str = HOST) -> dict[str, int]:
    """Ports the kernel hands out, all held until every one is chosen so that none repeats."""
    slots = port_slots(dep)
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in slots]
        for s in socks:
            s.bind((host, 0))
        return {name: s.getsockname()[1] for name, s in zip(slots, socks, strict=True)}


def choose_ports(dep: Dsv4Deployment, mode: PortMode, host: str = HOST) -> dict[str, int]:
    return free_ports(dep, host) if mode == "free" else spec_ports(dep, host)


def bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and the router bind
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# ---- cores ---------------------------------------------------------------------------------------


def split_cpus(cpus: Sequence[int], prefill: int, decode: int) -> dict[str, tuple[int, ...]]:
    """Cores per server: prefill servers get the first ceil(n/2) cores and decode servers the rest,
    each role's cores divided among its servers (round-robin when they outnumber them); on one core
    everyone shares it."""
    cores = sorted(cpus)
    if len(cores) < 2:
        return {name: tuple(cores) for name in _names(prefill, decode)}
    half = math.ceil(len(cores) / 2)
    out = dict(_divide("prefill", cores[:half], prefill))
    out |= dict(_divide("decode", cores[half:], decode))
    return out


def _names(prefill: int, decode: int) -> Iterator[str]:
    yield from (f"prefill-{i}" for i in range(prefill))
    yield from (f"decode-{i}" for i in range(decode))


def _divide(role: str, cores: list[int], count: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    if count > len(cores):
        for i in range(count):
            yield f"{role}-{i}", (cores[i % len(cores)],)
        return
    size, extra = divmod(len(cores), count)
    start = 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        yield f"{role}-{i}", tuple(cores[start:end])
        start = end


# ---- the whole local realisation ---------------------------------------------------------------


def model_source(dep: Dsv4Deployment) -> tuple[str, str]:
    """(the model directory on this machine, the spec field that names it)."""
    model = dep.spec.model
    if model.host_path is not None:
        return model.host_path.path, "spec.model.hostPath.path"
    if model.image is not None:
        return model.image.path, "spec.model.image.path"
    return model_path(dep), "spec.model.pvc"  # only where the claim is mounted as the pods mount it


def local(
    dep: Dsv4Deployment,
    *,
    model: str,
    ports: Mapping[str, int],
    cpus: Sequence[int],
    env: Mapping[str, str],
    host: str = HOST,
    claims: Path | None = None,
) -> Local:
    """claims: the directory whose subdirectory <claim name> stands for a PersistentVolumeClaim here
    (the prefix-cache volume's; without it, a spec with one is refused)."""
    if dep.spec.api_key_secret is not None and not env.get(API_KEY_ENV):
        secret = dep.spec.api_key_secret
        reason = f"set ${API_KEY_ENV} to the key (the Secret {secret.name}/{secret.key} is not read locally)"
        raise LocalError([("spec.apiKeySecret", reason)])
    vol, prefix_cache_dir = dep.spec.engine.prefix_cache_volume, None
    if vol is not None:
        if claims is None:
            raise LocalError([("spec.engine.prefixCacheVolume", "no directory stands for claims here")])
        prefix_cache_dir = str(claims / vol.claim_name / (vol.path or ""))
    shares = split_cpus(cpus, dep.spec.prefill.replicas, dep.spec.decode.replicas)
    first_bootstrap = ports.get("prefill-0.bootstrap", dep.spec.engine.bootstrap_port)
    servers = tuple(
        LocalServer(
            role=role,
            index=i,
            port=ports[f"{role}-{i}"],
            bootstrap_port=ports[f"prefill-{i}.bootstrap"] if role == "prefill" else first_bootstrap,
            metrics_port=ports[f"{role}-{i}.metrics"],
            cpus=shares[f"{role}-{i}"],
        )
        for role in SERVER_ROLES
        for i in range(getattr(dep.spec, role).replicas)
    )
    return Local(
        host=host,
        model=model,
        servers=servers,
        router_port=ports["router"],
        metrics_port=ports["router.metrics"],
        api_key=env.get(API_KEY_ENV) if dep.spec.api_key_secret is not None else None,
        cpus=tuple(sorted(cpus)),
        prefix_cache_dir=prefix_cache_dir,
    )
