"""The Mooncake transport backend (base.Transport over Mooncake's TransferEngine, P2P handshake: no
metadata server); `tcp` on CPU, `rdma` on GPU, `ascend` on NPU. Importing it does not import
Mooncake: creating a transport does."""

from dsv4_engine.disagg.mooncake.config import (
    MOONCAKE_ENV_DEFAULTS,
    apply_env_defaults,
    engine_device,
    session_host,
    transfer_hostname,
)
from dsv4_engine.disagg.mooncake.transfer_engine import DEFAULT_MAX_ENTRIES, MooncakeTransport


def create_transport(host: str, protocol: str, device: str = "cpu") -> MooncakeTransport:
    """This server's transport, reachable at `host` (the pod IP or --host) over `protocol`, for pools
    on `device` (--device: the NPU whose physical id the ascend hostname carries)."""
    npu, device_name = engine_device(protocol, device)
    return MooncakeTransport(transfer_hostname(host, protocol, npu), protocol, device_name)


__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "MOONCAKE_ENV_DEFAULTS",
    "MooncakeTransport",
    "apply_env_defaults",
    "create_transport",
    "engine_device",
    "session_host",
    "transfer_hostname",
]
