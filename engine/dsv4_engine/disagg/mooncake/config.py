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
