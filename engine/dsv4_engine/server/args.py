"""`dsv4 serve` command line -> ServerSettings.

The engine's flags come from its option list (`dsv4_engine.options`); the server's own are declared
here. Flags carry SGLang's and vLLM's names as aliases where the setting means the same here
(`--model-path`, `--tensor-parallel-size`, `--max-running-requests`, `--context-length`, ...). What
`dsv4 serve` checks before it binds its port is in preflight.py.
This module imports no torch: the operator's tests parse rendered command lines.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from dsv4_engine.options import UNLIMITED_CHUNK, EngineOptions, add_flags, byte_count, positive

__all__ = ["API_KEY_ENV", "UNLIMITED_CHUNK", "ServerSettings", "build_parser", "parse"]

API_KEY_ENV = "DSV4_API_KEY"
# The output parsers DSV4's output needs, under SGLang's name first and vLLM's second: the DSML tool
# calls (server/tool_parser.py) and the <think> block (server/reasoning.py). Other models' parsers
# are not served, so their names are refused rather than accepted and ignored.
TOOL_CALL_PARSERS = ("deepseekv4", "deepseek_v4")
REASONING_PARSERS = ("deepseek-v4", "deepseek_v4")


@dataclass
class ServerSettings(EngineOptions):
    """`dsv4 serve`'s settings: the engine's options (inherited, None where the engine decides) and
    the server's own."""

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    device: str = "auto"
    max_waiting: int = 256
    api_key: str | None = None
    grace_period: float = 25.0
    disaggregation_mode: str = "null"
    bootstrap_port: int | None = None
    metrics_port: int | None = None
    transfer_protocol: str = "tcp"
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    heartbeat_interval: float = 5.0
    heartbeat_failures: int = 2
    staging_mib: int = 64
    prefix_cache_dir: str | None = None
    prefix_cache_save_interval: float = 300.0
    prefix_cache_max_bytes: int | None = None
    prefix_cache_peers: list[str] = field(default_factory=list)
    prefix_cache_peer_timeout: float = 2.0
    log_level: str = "info"
    chat_template: str | None = None  # a template file, or the template itself (`prompts.py`)
    tool_call_parser: str = TOOL_CALL_PARSERS[0]
    reasoning_parser: str = REASONING_PARSERS[0]
    enable_auto_tool_choice: bool = False
    extra_engine_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for LLMEngine beyond (model_path, dtype, device): only what was set."""
        return {**self.explicit(), **self.extra_engine_kwargs}


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _urls(text: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    for url in urls:
        if not re.fullmatch(r"http://[^/\s]+", url):  # servers listen on plain HTTP
            raise argparse.ArgumentTypeError(f"expected base URLs such as http://host:port, got {url!r}")
    return urls


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default; a flag whose default is decided later says so in its help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4 serve",
        description="Serve one DSV4 model over an OpenAI-compatible API.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--model",
        "--model-path",  # SGLang's spelling
        dest="model",
        required=True,
        help="checkpoint directory (HF layout: config.json, safetensors, tokenizer), checked before the "
        "port is bound (required)",
    )
    p.add_argument("--served-model-name", help="name clients pass as `model` (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port")
    p.add_argument(
        "--metrics-port",
        type=positive(int),
        help="also serve /metrics (and nothing else) on this port, so a scraper can be let in without "
        "reaching the API (default: /metrics on --port only, as always)",
    )
    p.add_argument("--dtype", default="auto", help="weights dtype; auto: float32 on CPU, bfloat16 otherwise")
    p.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda[:N] or npu[:N]; auto: cuda if torch sees a GPU, else npu if torch_npu "
        "imports and sees an NPU, else cpu (the choice is logged)",
    )
    add_flags(p)  # the engine's options
    p.add_argument(
        "--max-waiting",
        "--max-queued-requests",  # SGLang's spelling
        dest="max_waiting",
        type=positive(int),
        default=256,
        help="queue bound; beyond it requests get 503",
    )
    p.add_argument("--api-key", help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV})")
    p.add_argument(
        "--grace-period",
        type=float,
        default=25.0,
        help="seconds to finish in-flight requests after SIGTERM before aborting them",
    )
    p.add_argument(
        "--disaggregation-mode",
        choices=["null", "prefill", "decode"],
        default="null",
        help="PD role: null serves whole requests; prefill or decode serve one half (docs/pd.md)",
    )
    p.add_argument(
        "--bootstrap-port",
        "--disaggregation-bootstrap-port",  # SGLang's spelling
        dest="bootstrap_port",
        type=positive(int),
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
        type=positive(float),
        default=300.0,
        help="prefill: seconds a room waits for a decode server to claim it and send its pages",
    )
    p.add_argument(
        "--disaggregation-waiting-timeout",
        dest="waiting_timeout",
        type=positive(float),
        default=300.0,
        help="decode: seconds from reserving a request's pages to the end of its transfer",
    )
    p.add_argument(
        "--disaggregation-heartbeat-interval",
        dest="heartbeat_interval",
        type=positive(float),
        default=5.0,
        help="decode: seconds between health checks of each prefill bootstrap endpoint",
    )
    p.add_argument(
        "--disaggregation-heartbeat-failures",
        dest="heartbeat_failures",
        type=positive(int),
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
    p.add_argument(
        "--prefix-cache-dir",
        help="a directory for the prefix cache's snapshots: written when the server drains, read when "
        "it starts, so a restarted server, or another of the same checkpoint and memory layout "
        "sharing the directory, resumes prompts it has seen from the cache (docs/memory.md) (default: "
        "none: the cache lives and dies with the process)",
    )
    p.add_argument(
        "--prefix-cache-save-interval",
        type=_seconds,
        default=300.0,
        help="with --prefix-cache-dir: seconds between saves while serving, each only if the cache "
        "changed, so a crash loses at most this much; 0 saves only after a drain",
    )
    p.add_argument(
        "--prefix-cache-max-bytes",
        type=byte_count,
        help="with --prefix-cache-dir: the file's size cap (bytes, or with Ki, Mi, Gi, Ti), filled "
        "with the most recently used prefixes; size it to what the drain's grace period can write "
        "(default: every prefix)",
    )
    p.add_argument(
        "--prefix-cache-peers",
        type=_urls,
        default=[],
        help="comma-separated base URLs of servers of the same checkpoint and memory layout whose "
        "prefix caches this one fetches from when they resume a prompt further than its own (a host "
        "resolving to several addresses, such as a headless Service, means every one; this server's "
        "own address and port is left out, so a role's servers can share one list) (default: none)",
    )
    p.add_argument(
        "--prefix-cache-peer-timeout",
        type=_seconds,
        default=2.0,
        help="with --prefix-cache-peers: the most seconds a request waits for them before it prefills "
        "without",
    )
    p.add_argument(
        "--chat-template",
        help="the chat template (Jinja): a file, or the template text itself, as vLLM's flag; it "
        "replaces the checkpoint's for /v1/chat/completions, /v1/responses and /tokenize "
        "(default: the checkpoint's)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=TOOL_CALL_PARSERS[0],
        help="how tool calls are read from the output: DeepSeek-V4's DSML (SGLang's name, or vLLM's)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=REASONING_PARSERS[0],
        help="how reasoning is split from the answer: DeepSeek-V4's <think> block (SGLang's name, or "
        "vLLM's); on whenever a request turns thinking on",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines: tool_choice auto is always served here",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="one line per request at info",
    )
    return p


def parse(argv: list[str]) -> ServerSettings:
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    values["api_key"] = values["api_key"] or os.environ.get(API_KEY_ENV) or None
    if values["grace_period"] < 0:
        build_parser().error("--grace-period must be >= 0")
    if values["metrics_port"] is not None and values["metrics_port"] in (
        values["port"],
        values["bootstrap_port"],
    ):
        build_parser().error("--metrics-port must differ from --port and --bootstrap-port")
    if values["prefix_cache_peers"] and values.get("disable_radix_cache"):
        build_parser().error("--prefix-cache-peers needs the prefix cache: drop --disable-radix-cache")
    return ServerSettings(**values)
