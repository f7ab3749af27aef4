"""How this process's Mooncake is set up: its hostname per protocol, the environment it reads, and
the timeout a write is held to."""

from __future__ import annotations

import os
import re
import socket

# Set before the engine exists, only where the user has not (TcpTransport reads them when created;
# the slice size once per process). bench/pd_transfer.py, small preset, one 4096-token request
# (3.9 MiB), 2 shared cores, loopback, 0.3.13.post1:
# - lanes (connections per peer, 1..16, default 4), all interleaved in one run: fragmented pools
#   (302 entries) 0.48 / 0.59 / 0.63 GB/s for 1 / 4 / 16 lanes; fresh pools (23 entries) the same
#   within noise (1.8-2.3 GB/s, two runs);
# - slice (bytes a lane sends before the next, default 64 KiB): fresh pools 1.6 GB/s at 64 KiB,
#   2.3 at 1 MiB, 2.1 at 4 MiB (three alternated runs each); peers with different slices interoperate;
# - queue limits: 8 concurrent batches of transfer_engine.DEFAULT_MAX_ENTRIES to one peer instead of 2.
MOONCAKE_ENV_DEFAULTS: dict[str, str] = {
    "MC_TCP_LANES_PER_PEER": "16",
    "MC_TCP_SLICE_SIZE": str(1 << 20),
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "8192",
}


def apply_env_defaults(env: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Set MOONCAKE_ENV_DEFAULTS where unset; returns the values in effect."""
    for key, value in MOONCAKE_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    return {key: env[key] for key in MOONCAKE_ENV_DEFAULTS}


# How long past its own transfer timeout an entry Mooncake still reports pending is waited for
# before its source is given back (transfer_engine.LateEntries); the decode's quarantine without
# word from the prefill is the same timeout plus this (protocol.quarantine_seconds).
LATE_MARGIN_SECONDS = 5.0


def transfer_timeout_s(env: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """Mooncake's synchronous-write timeout (MC_TRANSFER_TIMEOUT, at least 5 s, default 30 s): a write
    waits this long plus 1 ns a byte, as batch_transfer_sync_write would."""
    value = env.get("MC_TRANSFER_TIMEOUT")
    try:
        return float(max(5, int(value))) if value else 30.0
    except ValueError:
        return 30.0


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


IB_DEVICE_ENV = "DSV4_DISAGGREGATION_IB_DEVICE"  # SGLang's --disaggregation-ib-device (a flag later)
PROTOCOLS = ("tcp", "rdma", "ascend")


def npu_phy_id(device: str, env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """The physical id of the NPU this server's pools live on (`device` is --device: npu:K is logical
    index K, 0 by default): ASCEND_RT_VISIBLE_DEVICES lists the physical ids the logical indices map
    to; without it the logical index is the physical one. ValueError naming what is missing."""
    kind, _, index = device.partition(":")
    logical = int(index) if index.isdigit() else 0
    visible = [v.strip() for v in env.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if logical >= len(visible) or not visible[logical].isdigit():
            raise ValueError(f"--transfer-protocol ascend: ASCEND_RT_VISIBLE_DEVICES={env['ASCEND_RT_VISIBLE_DEVICES']!r} "
                             f"has no physical id for logical NPU {logical} (--device {device})")  # fmt: skip
        return int(visible[logical])
    if kind != "npu":
        raise ValueError(f"--transfer-protocol ascend needs an NPU, and this server has none (--device {device}, "
                         "ASCEND_RT_VISIBLE_DEVICES unset): serve with --device npu[:K], or set "
                         "ASCEND_RT_VISIBLE_DEVICES")  # fmt: skip
    return logical


def engine_device(
    protocol: str, device: str, env: dict[str, str] | os._Environ[str] = os.environ
) -> tuple[int | None, str]:
    """(NPU physical id for the hostname, Mooncake's device_name) for `protocol`: ascend needs the
    NPU's physical id (npu_phy_id), rdma takes the RDMA devices in $DSV4_DISAGGREGATION_IB_DEVICE (Mooncake
    picks one when empty), tcp neither. ValueError (a startup error, naming what is missing) else."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"--transfer-protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if protocol == "ascend":
        return npu_phy_id(device, env), ""
    if protocol == "rdma":
        return None, env.get(IB_DEVICE_ENV, "").strip()
    return None, ""


def transfer_hostname(
    host: str, protocol: str, npu_phy_id: int | None = None, *, port: int | None = None
) -> str:
    """The local_hostname Mooncake's initialize() takes for this protocol.

    "ascend" (Mooncake over the Ascend transport, SGLang's ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE) wants
    "<host>:<port>:npu_<physical id>", port a free one on host (picked here unless given, the only
    impure case); every other protocol takes the host as is. Peers dial "<host>:<rpc port>" either
    way (MooncakeTransport.session_id).
    """
    if protocol != "ascend":
        return host
    if npu_phy_id is None or npu_phy_id < 0:
        raise ValueError(f"protocol 'ascend' needs the NPU's physical id, got {npu_phy_id}")
    return f"{host}:{_free_port(host) if port is None else port}:npu_{npu_phy_id}"


_ASCEND_SUFFIX = re.compile(r":\d+:npu_\d+$")


def session_host(hostname: str) -> str:
    """The host part of a transfer_hostname(): what a session id starts with (IPv6 in brackets)."""
    host = _ASCEND_SUFFIX.sub("", hostname)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
