"""spec -> plan: the roles, their names, labels, ports and command lines, independent of how they are
realised (Kubernetes objects in manifests.py, local processes in the launcher).

The command lines are built by `serve_args` and `router_args`, which take the host-specific values
(model path, ports, how the router finds its servers) as parameters, so both drivers share them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from dsv4_operator.fingerprint import deployment_fingerprint
from dsv4_operator.spec import Dsv4Deployment, EngineSpec

Role = Literal["prefill", "decode", "router"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "router")

# Label keys: the contract between the manifests, the operator and the router selectors.
L_NAME = "app.kubernetes.io/name"
L_INSTANCE = "app.kubernetes.io/instance"
L_COMPONENT = "app.kubernetes.io/component"
L_MANAGED_BY = "app.kubernetes.io/managed-by"
L_DEPLOYMENT = "dsv4.ai/deployment"
L_ROLE = "dsv4.ai/role"
L_FINGERPRINT = "dsv4.ai/fingerprint"
A_BOOTSTRAP_PORT = "sglang.ai/bootstrap-port"  # read by sglang-router 0.3.2 (hard-coded there)
# Container port names: probes, Services, the NetworkPolicy and the PodMonitor refer to them.
PORT_HTTP = "http"
PORT_BOOTSTRAP = "bootstrap"
PORT_METRICS = "metrics"  # /metrics alone: servers' --metrics-port, the router's --prometheus-port
POD_MONITOR_API = "monitoring.coreos.com/v1"  # Prometheus Operator; its CRDs may be absent
APP = "dsv4"
MANAGER = "dsv4-operator"

MODEL_MOUNT = "/models"
CONFIG_MOUNT = "/etc/dsv4"
# Compiled decode steps (torch.compile's artefacts), kept across container restarts.
COMPILE_CACHE_MOUNT = "/var/cache/dsv4"
PREFIX_CACHE_MOUNT = "/var/lib/dsv4/prefix-cache"  # spec.engine.prefixCacheVolume, on prefill pods
DRAIN_MARGIN_SECONDS = 30  # a server's exit after its drain's grace period
PREFIX_CACHE_WRITE_SECONDS = 120  # a prefill server writing its prefix cache to the volume, after the drain
PROBE_PERIOD_SECONDS = 10
ROUTER_COMMAND = ("python3", "-m", "sglang_router.launch_router")
SERVE_COMMAND = ("dsv4", "serve")
# On NPUs the server starts through the engine-ascend image's entrypoint, which sources CANN's
# set_env.sh first (torch_npu needs CANN's libraries on LD_LIBRARY_PATH when Python starts).
ASCEND_SERVE_COMMAND = ("dsv4-ascend", "serve")
ROUTER_HEALTH_INTERVAL_SECONDS = 5
ROUTER_HEALTH_FAILURES = 2


@dataclass(frozen=True)
class RolePlan:
    role: Role
    name: str  # of the role's workload, headless Service and PDB: <deployment>-<role>-<fingerprint>
    replicas: int
    selector: dict[str, str]  # immutable workload selector; the router discovers servers by it
    labels: dict[str, str]  # pod and object labels (selector plus descriptive ones)
    ports: dict[str, int]
    command: tuple[str, ...]
    args: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    name: str
    namespace: str
    fingerprint: str
    serving_fingerprint: str
    model_path: str  # inside the containers
    prefill: RolePlan
    decode: RolePlan
    router: RolePlan
    endpoint_service: str
    endpoint_port: int
    config_map: str
    router_account: str
    network_policy: str
    startup_failure_threshold: int

    def role(self, role: Role) -> RolePlan:
        return {"prefill": self.prefill, "decode": self.decode, "router": self.router}[role]

    @property
    def endpoint(self) -> str:
        return f"http://{self.endpoint_service}.{self.namespace}.svc:{self.endpoint_port}/v1"

    def selector_string(self, role: Role) -> str:
        """The role's selector as a label-selector string (for status.<role>.selector / scale)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.role(role).selector.items()))


def common_labels(name: str) -> dict[str, str]:
    return {L_NAME: APP, L_INSTANCE: name, L_MANAGED_BY: MANAGER, L_DEPLOYMENT: name}


def role_selector(name: str, role: Role, fingerprint: str) -> dict[str, str]:
    return {L_NAME: APP, L_DEPLOYMENT: name, L_ROLE: role, L_FINGERPRINT: fingerprint}


def model_path(dep: Dsv4Deployment) -> str:
    model = dep.spec.model
    if model.pvc is not None:
        return f"{MODEL_MOUNT}/{model.pvc.path}" if model.pvc.path else MODEL_MOUNT
    if model.host_path is not None:
        return MODEL_MOUNT
    assert model.image is not None  # parse() guarantees exactly one source
    return model.image.path


def stop_seconds(dep: Dsv4Deployment, role: Literal["prefill", "decode"]) -> int:
    """How long a server of `role` may take to stop after SIGTERM: the drain's grace period, then its
    exit, and where a prefill server keeps its prefix cache on a volume, the writing of it."""
    eng = dep.spec.engine
    keeps = role == "prefill" and eng.prefix_cache_volume is not None
    return eng.grace_period_seconds + DRAIN_MARGIN_SECONDS + (PREFIX_CACHE_WRITE_SECONDS if keeps else 0)


def prefix_cache_dir(dep: Dsv4Deployment) -> str | None:
    """Where prefill pods keep their prefix cache across restarts (None: they do not)."""
    vol = dep.spec.engine.prefix_cache_volume
    if vol is None:
        return None
    return f"{PREFIX_CACHE_MOUNT}/{vol.path}" if vol.path else PREFIX_CACHE_MOUNT


def _prefix_cache_args(eng: EngineSpec, directory: str) -> list[str]:
    vol = eng.prefix_cache_volume
    assert vol is not None
    return [
        "--prefix-cache-dir", directory,
        *(["--prefix-cache-max-bytes", vol.max_size] if vol.max_size else []),
        *(["--prefix-cache-save-interval", str(vol.save_interval_seconds)]
          if vol.save_interval_seconds is not None else []),
    ]  # fmt: skip


def serve_args(
    dep: Dsv4Deployment,
    role: Literal["prefill", "decode"],
    *,
    model: str,
    host: str,
    port: int,
    bootstrap_port: int,
    metrics_port: int,
    prefix_cache: str | None = None,
    peers: Sequence[str] = (),
) -> list[str]:
    """Arguments of `dsv4 serve` for one server of `role` (flag names: the engine's contract).
    prefix_cache: the prefill servers' --prefix-cache-dir (the decode caches nothing). peers: the
    prefill servers' --prefix-cache-peers, every prefill server of the deployment (each leaves
    itself out): the router 0.3.2 spreads a conversation's turns over them, and a server fetches
    from the others' caches what its own lacks."""
    eng, rs = dep.spec.engine, getattr(dep.spec, role)
    args = [
        "--model", model,
        "--served-model-name", dep.spec.model.served_model_name,
        "--host", host,
        "--port", str(port),
        "--device", eng.device,
        "--dtype", eng.dtype,
        "--page-size", str(eng.page_size),
        "--max-model-len", str(eng.max_model_len),
        "--chunked-prefill-size", str(eng.chunked_prefill_size),
        "--max-num-seqs", str(eng.max_num_seqs),
        "--max-waiting", str(eng.max_waiting),
        "--grace-period", str(eng.grace_period_seconds),
        *([] if eng.enforce_eager else ["--no-enforce-eager"]),
        *([] if eng.prefix_cache else ["--disable-radix-cache"]),
        *(_prefix_cache_args(eng, prefix_cache) if prefix_cache and role == "prefill" else []),
        *(["--prefix-cache-peers", ",".join(peers)] if peers and eng.prefix_cache and role == "prefill" else []),
        # Both roles: the decode drafts, the prefill's MTP layer makes the first step's drafts.
        *(["--speculative-num-steps", str(eng.speculative_num_steps)] if eng.speculative_num_steps else []),
        "--disaggregation-mode", role,
        "--transfer-protocol", eng.transfer_protocol,
        "--tp-size", str(rs.tensor_parallel_size),
        "--ep-size", str(rs.expert_parallel_size),
        # Prefill: its bootstrap endpoint. Decode: what a request's null bootstrap_port means (the
        # router sends null when it has no port for the prefill), so both roles carry it.
        "--bootstrap-port", str(bootstrap_port),
        # A second listener serving only /metrics: scrapers reach it, never the generation port.
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    return args


def router_policy_args(dep: Dsv4Deployment) -> list[str]:
    # sglang-router 0.3.2 seeds no cache-aware tree with PD workers, so `cache_aware` for prefill
    # picks at random ("No tree found for model ..., using random worker selection" at debug level,
    # on every prefill pick of a bench/prefix.py run), whether given as `--prefill-policy` or as the
    # main `--policy`; no flag of 0.3.2 changes that. Fixed upstream in smg (sgl-model-gateway's
    # successor), PR #1520. `manual` works on 0.3.2: it keeps each X-SMG-Routing-Key on one server
    # and needs no tree. Whatever the pick, a prefill server fetches from the others' prefix caches
    # what a prompt's prefix lacks (`--prefix-cache-peers`, serve_args).
    r = dep.spec.router
    return ["--pd-disaggregation", "--prefill-policy", r.prefill_policy, "--decode-policy", r.decode_policy]


def router_args(
    dep: Dsv4Deployment,
    *,
    host: str,
    port: int,
    metrics_port: int,
    tokenizer_path: str,
    discovery: list[str],
    api_key: str | None,
    startup_timeout_seconds: int,
) -> list[str]:
    """Arguments of sglang-router 0.3.2's launch_router, listening (and serving metrics) on `host`.
    `discovery` says how servers are found: service-discovery flags on Kubernetes,
    `--prefill URL PORT --decode URL` locally."""
    r = dep.spec.router
    args = [
        "--host", host,
        "--port", str(port),
        *router_policy_args(dep),
        *discovery,
        "--tokenizer-path", tokenizer_path,
        "--worker-startup-timeout-secs", str(startup_timeout_seconds),
        "--request-timeout-secs", str(r.request_timeout_seconds),
        "--health-check-endpoint", "/health",
        # A draining or dead server leaves the rotation within 2 x 5 s (0.3.2's default: 3 x 60 s).
        "--health-check-interval-secs", str(ROUTER_HEALTH_INTERVAL_SECONDS),
        "--health-failure-threshold", str(ROUTER_HEALTH_FAILURES),
        # Its breaker counts a decode's back-pressure 503s: two refused requests (10 attempts) opened
        # it for 60 s on every worker of a healthy, idle deployment. Health checks exclude dead ones.
        "--disable-circuit-breaker",
        "--prometheus-host", host,
        "--prometheus-port", str(metrics_port),
        "--log-level", "info",
    ]  # fmt: skip
    if api_key is not None:
        args += ["--api-key", api_key]
    return args


def _selector_args(flag: str, selector: dict[str, str]) -> list[str]:
    return [flag, *(f"{k}={v}" for k, v in sorted(selector.items()))]


def plan(
    dep: Dsv4Deployment, *, serving_fingerprint: str | None = None, namespace: str | None = None
) -> Plan:
    spec, name = dep.spec, dep.metadata.name
    ns = namespace or dep.metadata.namespace or "default"
    fp = deployment_fingerprint(dep)
    path = model_path(dep)
    eng = spec.engine
    roles: dict[Role, RolePlan] = {}
    for role in ("prefill", "decode"):
        sel = role_selector(name, role, fp)
        metrics = spec.monitoring.metrics_port
        ports = {PORT_HTTP: eng.port}
        ports |= {PORT_BOOTSTRAP: eng.bootstrap_port} if role == "prefill" else {}
        ports |= {PORT_METRICS: metrics}
        role_name = f"{name}-{role}-{fp}"
        # The role's headless Service resolves to every ready pod of it.
        args = serve_args(
            dep, role, model=path, host="0.0.0.0", port=eng.port, bootstrap_port=eng.bootstrap_port,
            metrics_port=metrics, prefix_cache=prefix_cache_dir(dep), peers=[f"http://{role_name}:{eng.port}"],
        )  # fmt: skip
        roles[role] = RolePlan(
            role=role,
            name=role_name,
            replicas=getattr(spec, role).replicas,
            selector=sel,
            labels=common_labels(name) | {L_COMPONENT: role} | sel,
            ports=ports,
            command=ASCEND_SERVE_COMMAND if eng.device == "npu" else SERVE_COMMAND,
            args=tuple(args),
        )
    # Kubernetes substitutes $(VAR) in args from the container's env: no namespace or key is baked in.
    discovery = [
        "--service-discovery",
        "--service-discovery-namespace", "$(POD_NAMESPACE)",
        "--service-discovery-port", str(eng.port),
        *_selector_args("--prefill-selector", roles["prefill"].selector),
        *_selector_args("--decode-selector", roles["decode"].selector),
    ]  # fmt: skip
    r_sel = role_selector(name, "router", fp)
    roles["router"] = RolePlan(
        role="router",
        name=f"{name}-router-{fp}",
        replicas=spec.router.replicas,
        selector=r_sel,
        labels=common_labels(name) | {L_COMPONENT: "router"} | r_sel,
        ports={PORT_HTTP: spec.router.port, PORT_METRICS: spec.router.metrics_port},
        command=ROUTER_COMMAND,
        args=tuple(
            router_args(
                dep,
                host="0.0.0.0",
                port=spec.router.port,
                metrics_port=spec.router.metrics_port,
                tokenizer_path=path,
                discovery=discovery,
                api_key="$(DSV4_API_KEY)" if spec.api_key_secret else None,
                startup_timeout_seconds=spec.probes.startup_timeout_seconds,
            )
        ),
    )
    return Plan(
        name=name,
        namespace=ns,
        fingerprint=fp,
        serving_fingerprint=serving_fingerprint or fp,
        model_path=path,
        prefill=roles["prefill"],
        decode=roles["decode"],
        router=roles["router"],
        endpoint_service=name,
        endpoint_port=spec.service.port,
        config_map=f"{name}-engine-{fp}",
        router_account=f"{name}-router",
        network_policy=f"{name}-workers",
        startup_failure_threshold=math.ceil(spec.probes.startup_timeout_seconds / PROBE_PERIOD_SECONDS),
    )
