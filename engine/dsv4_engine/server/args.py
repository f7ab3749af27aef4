"""`dsv4 serve` command line -> ServerSettings."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

API_KEY_ENV = "DSV4_API_KEY"


@dataclass
class ServerSettings:
    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    device: str = "cpu"
    page_size: int | None = None
    max_model_len: int | None = None
    chunked_prefill_size: int | None = None
    max_num_seqs: int | None = None
    num_pages: int | None = None
    enforce_eager: bool = True
    max_waiting: int = 256
    api_key: str | None = None
    grace_period: float = 25.0
    disaggregation_mode: str = "null"
    bootstrap_port: int | None = None
    transfer_protocol: str = "tcp"
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    heartbeat_interval: float = 5.0
    heartbeat_failures: int = 2
    staging_mib: int = 64
    tp_size: int = 1
    ep_size: int = 1
    log_level: str = "info"
    extra_engine_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for LLMEngine beyond (model_path, dtype, device): only what was set."""
        kwargs: dict[str, Any] = {}
        for name in ("page_size", "max_model_len", "chunked_prefill_size", "max_num_seqs", "num_pages"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if not self.enforce_eager:
            kwargs["enforce_eager"] = False
        for name in ("tp_size", "ep_size"):
            if getattr(self, name) != 1:
                kwargs[name] = getattr(self, name)
        kwargs.update(self.extra_engine_kwargs)
        return kwargs


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4 serve", description="Serve one DSV4 model over an OpenAI-compatible API."
    )
    p.add_argument("--model", required=True, help="checkpoint directory (HF format)")
    p.add_argument("--served-model-name", help="name clients pass as `model` (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--page-size", type=_positive(int))
    p.add_argument("--max-model-len", type=_positive(int))
    p.add_argument("--chunked-prefill-size", type=_positive(int))
    p.add_argument("--max-num-seqs", type=_positive(int))
    p.add_argument(
        "--num-pages",
        type=_positive(int),
        help="full pages (page-size tokens each) for the KV pools instead of a share of free memory",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode eagerly (default); --no-enforce-eager compiles (CPU) or captures (GPU/NPU) a decode "
        "step per batch-size bucket up to --max-num-seqs at start-up, before serving",
    )
    p.add_argument(
        "--max-waiting", type=_positive(int), default=256, help="queue bound; beyond it requests get 503"
    )
    p.add_argument("--api-key", help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV})")
    p.add_argument(
        "--grace-period",
        type=float,
        default=25.0,
        help="seconds to finish in-flight requests after SIGTERM before aborting them",
    )
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
    p.add_argument(
        "--bootstrap-port",
        "--disaggregation-bootstrap-port",  # SGLang's spelling
        dest="bootstrap_port",
        type=_positive(int),
        help="prefill: the bootstrap endpoint's port; decode: the port a request's null bootstrap_port "
        "means (default 8998, as SGLang)",
    )
    p.add_argument(
        "--transfer-protocol",
        choices=["tcp", "rdma", "ascend"],
        default="tcp",
        help="Mooncake transport: tcp (CPU), rdma (GPU), ascend (NPU)",
    )
    # The PD fault bounds default to SGLang's (its environ.py): 300 s, 300 s, a heartbeat of 5 s x 2.
    p.add_argument(
        "--disaggregation-bootstrap-timeout",
        dest="bootstrap_timeout",
        type=_positive(float),
        default=300.0,
        help="prefill: seconds a room waits for a decode server to claim it and send its pages",
    )
    p.add_argument(
        "--disaggregation-waiting-timeout",
        dest="waiting_timeout",
        type=_positive(float),
        default=300.0,
        help="decode: seconds from reserving a request's pages to the end of its transfer",
    )
    p.add_argument(
        "--disaggregation-heartbeat-interval",
        dest="heartbeat_interval",
        type=_positive(float),
        default=5.0,
        help="decode: seconds between health checks of each prefill bootstrap endpoint",
    )
    p.add_argument(
        "--disaggregation-heartbeat-failures",
        dest="heartbeat_failures",
        type=_positive(int),
        default=2,
        help="decode: missed health checks after which a prefill server's rooms fail",
    )
    p.add_argument(
        "--disaggregation-staging-mib",
        dest="staging_mib",
        type=_non_negative_int,
        default=64,
        help="PD: MiB of registered staging memory; a request whose pages are scattered goes packed "
        "through it as one transfer entry instead of one per page run (decode: a span per request "
        "being received; prefill: one write at a time); 0 writes every page directly",
    )
    p.add_argument("--tp-size", type=_positive(int), default=1)
    p.add_argument("--ep-size", type=_positive(int), default=1)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def parse(argv: list[str]) -> ServerSettings:
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    values["api_key"] = values["api_key"] or os.environ.get(API_KEY_ENV) or None
    if values["grace_period"] < 0:
        build_parser().error("--grace-period must be >= 0")
    return ServerSettings(**values)
