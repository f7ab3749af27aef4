"""`dsv4 serve` command line -> ServerSettings, and the checks `dsv4 serve` runs before it binds.

Flags carry SGLang's and vLLM's names as aliases where the setting means the same here
(`--model-path`, `--tensor-parallel-size`, `--max-running-requests`, `--context-length`, ...).
This module imports no torch at import time: the operator's tests parse rendered command lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

API_KEY_ENV = "DSV4_API_KEY"
DEVICES = ("auto", "cpu", "cuda", "npu")
UNLIMITED_CHUNK = -1  # --chunked-prefill-size: no per-request chunk cap (engine_config.UNLIMITED_CHUNK)
_IEC = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
# Engine setting names as the engine's errors spell them -> the flag that sets them.
_SETTING_FLAGS = {
    "chunked_prefill_size": "--chunked-prefill-size",
    "chunk_size": "--chunked-prefill-size",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len",
    "page_size": "--page-size",
    "num_pages": "--num-pages",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "dtype": "--dtype",
    "device": "--device",
    "tp_size": "--tp-size",
    "ep_size": "--ep-size",
}


@dataclass
class ServerSettings:
    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    device: str = "auto"
    page_size: int | None = None
    max_model_len: int | None = None
    chunked_prefill_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_pages: int | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = True
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
        for name in (
            "page_size",
            "max_model_len",
            "chunked_prefill_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_pages",
            "kv_cache_memory_bytes",
        ):
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


def _chunk_size(text: str) -> int:
    value = int(text)
    if value != UNLIMITED_CHUNK and value <= 0:
        raise argparse.ArgumentTypeError(f"must be -1 (no per-request cap) or positive, got {text}")
    return value


def _bytes(text: str) -> int:
    """A byte count, optionally with an IEC suffix (`8Gi`, `512MiB`): SI and bare-letter suffixes
    mean different things in different vLLM releases, so they are refused rather than guessed."""
    m = re.fullmatch(r"(\d+)(?:(Ki|Mi|Gi|Ti)B?)?", text.strip())
    if m is None or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive byte count, optionally with Ki/Mi/Gi/Ti; got {text!r}"
        )
    return int(m.group(1)) * _IEC[m.group(2) or ""]


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
        type=_positive(int),
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
    p.add_argument(
        "--page-size",
        "--block-size",  # vLLM's spelling
        dest="page_size",
        type=_positive(int),
        help="tokens per KV page (default: the engine's, 128)",
    )
    p.add_argument(
        "--max-model-len",
        "--context-length",  # SGLang's spelling
        dest="max_model_len",
        type=_positive(int),
        help="context length, prompt plus completion (default: the engine's, 16384, capped by the "
        "checkpoint's max_position_embeddings)",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=_chunk_size,
        help="per-request prefill chunk in tokens, a multiple of --page-size; -1: no per-request cap, a "
        "prompt is then split only where it exceeds a step's --max-num-batched-tokens "
        "(default: one page)",
    )
    p.add_argument(
        "--max-num-seqs",
        "--max-running-requests",  # SGLang's spelling
        dest="max_num_seqs",
        type=_positive(int),
        help="requests running at once (default: the engine's, 64)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive(int),
        help="tokens one engine step may process, decodes plus prefill chunks, as vLLM's flag "
        "(default: the engine's, 2048, or the chunk size if larger)",
    )
    p.add_argument(
        "--num-pages",
        type=_positive(int),
        help="full pages (page-size tokens each) for the KV pools instead of a share of free memory "
        "(default: sized from memory)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=_bytes,
        help="bytes for the KV pools (e.g. 8Gi), as vLLM's flag, instead of a share of the memory free "
        "at start; not with --num-pages (default: a quarter of available host memory on CPU, 0.8 of "
        "free device memory otherwise, at most --max-num-seqs full contexts)",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode eagerly (default); --no-enforce-eager compiles (CPU) or captures (GPU/NPU) a decode "
        "step per batch-size bucket up to --max-num-seqs at start-up, before serving",
    )
    p.add_argument(
        "--max-waiting",
        "--max-queued-requests",  # SGLang's spelling
        dest="max_waiting",
        type=_positive(int),
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
    p.add_argument(
        "--tp-size",
        "--tensor-parallel-size",  # SGLang's and vLLM's spelling
        "--tp",
        "-tp",  # vLLM's short form
        dest="tp_size",
        type=_positive(int),
        default=1,
        help="tensor-parallel size: this many processes, one per rank (gloo on CPU, HCCL on NPU, NCCL "
        "on GPU); query heads, output projections and experts are split, the latent replicated",
    )
    p.add_argument(
        "--ep-size",
        "--expert-parallel-size",  # SGLang's spelling
        "--ep",
        dest="ep_size",
        type=_positive(int),
        default=1,
        help="expert-parallel size (divides --tp-size): routed experts split this many ways, each "
        "expert's intermediate size --tp-size / --ep-size ways",
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
    return ServerSettings(**values)


class SettingsError(Exception):
    """A setting `dsv4 serve` refuses before it binds its port; str() is the line it prints."""

    def __init__(self, flag: str | None, message: str) -> None:
        text = " ".join(message.split())  # one line, whatever the cause's message held
        super().__init__(f"{flag}: {text}" if flag else text)
        self.flag = flag


def resolve_device(device: str) -> str:
    """`auto` -> cuda if torch sees a GPU, else npu if torch_npu imports and sees an NPU (the device
    layer's check, so torch_npu is imported only where CUDA is absent), else cpu."""
    if device.split(":")[0] not in DEVICES or device.startswith("auto:"):
        raise SettingsError("--device", f"must be auto, cpu, cuda[:N] or npu[:N], got {device!r}")
    if device != "auto":
        return device  # whether it is there: EngineConfig.build, in check()
    import torch

    from dsv4_engine.device import npu_available

    if torch.cuda.is_available():
        return "cuda"
    return "npu" if npu_available() else "cpu"


def _flag_in(message: str) -> str | None:
    """The flag of the engine setting named first in one of the engine's error messages."""
    hits = [
        (m.start(), flag)
        for name, flag in _SETTING_FLAGS.items()
        if (m := re.search(rf"\b{name}\b", message))
    ]
    return min(hits)[1] if hits else None


def _checkpoint_config(model: str) -> Any:
    path = Path(model).expanduser()
    if not path.is_dir():
        raise SettingsError(
            "--model", f"{model}: {'not a directory' if path.exists() else 'no such directory'}"
        )
    if not (path / "config.json").is_file():
        raise SettingsError("--model", f"{model}: no config.json here (expected an HF checkpoint directory)")
    from dsv4_engine.config import Dsv4Config

    try:
        return Dsv4Config.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:  # unreadable or malformed config.json
        raise SettingsError("--model", f"{path / 'config.json'}: {exc}") from exc


def check(settings: ServerSettings) -> ServerSettings:
    """What `dsv4 serve` checks before it binds its port: the checkpoint directory, the device, and
    the engine's settings as the engine resolves them. Returns the settings with the device resolved;
    raises SettingsError naming the flag."""
    config = _checkpoint_config(settings.model)
    if settings.num_pages is not None and settings.kv_cache_memory_bytes is not None:
        raise SettingsError("--kv-cache-memory-bytes", "give it or --num-pages, not both")
    device = resolve_device(settings.device)
    from dsv4_engine.engine_config import EngineConfig

    accepted = inspect.signature(EngineConfig.build).parameters
    kwargs = {k: v for k, v in settings.engine_kwargs().items() if k in accepted}
    try:
        built = EngineConfig.build(
            settings.model,
            settings.dtype,
            device,
            max_position_embeddings=config.max_position_embeddings,
            **kwargs,
        )
        built.scheduler_config(())  # the scheduler's own rules (the step budget holds a page)
    except (ValueError, RuntimeError) as exc:
        raise SettingsError(_flag_in(str(exc)), str(exc)) from exc
    if settings.tp_size > 1:
        from dsv4_engine.parallel.shard import check_sizes

        try:
            check_sizes(config, settings.tp_size, settings.ep_size)
        except ValueError as exc:
            flag = "--ep-size" if "ep_size" in str(exc) and settings.ep_size > 1 else "--tp-size"
            raise SettingsError(flag, f"{exc} (in {settings.model})") from exc

    return dataclasses.replace(settings, device=device)
