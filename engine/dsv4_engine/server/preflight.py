"""What `dsv4 serve` checks before it binds its port: the checkpoint directory, the device, and the
engine's settings as the engine resolves them. A refusal is a SettingsError naming the flag, which
`dsv4 serve` prints as one line before exiting 2.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from dsv4_engine import options
from dsv4_engine.server.args import ServerSettings

DEVICES = ("auto", "cpu", "cuda", "npu")
# Engine setting names as the engine's errors spell them -> the flag that sets them.
_SETTING_FLAGS = {
    **options.flags(),
    "chunk_size": "--chunked-prefill-size",  # the scheduler's name for it
    "dtype": "--dtype",
    "device": "--device",
}


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
    if settings.chat_template is not None:
        from dsv4_engine.server.prompts import template_text

        try:
            template_text(settings.chat_template)
        except ValueError as exc:
            raise SettingsError("--chat-template", str(exc)) from exc
    from dsv4_engine.engine_config import EngineConfig

    asked, _ = options.split(settings.engine_kwargs())
    try:
        built = EngineConfig.build(
            settings.model,
            settings.dtype,
            device,
            max_position_embeddings=config.max_position_embeddings,
            **asked,
        )
        built.scheduler_config(())  # the scheduler's own rules (the step budget holds a page)
    except (ValueError, RuntimeError) as exc:
        raise SettingsError(_flag_in(str(exc)), str(exc)) from exc
    if settings.prefix_cache_max_bytes is not None and settings.prefix_cache_dir is None:
        raise SettingsError(
            "--prefix-cache-max-bytes", "caps the file of --prefix-cache-dir, which is not set"
        )
    if settings.prefix_cache_dir is not None:
        if settings.disable_radix_cache:
            raise SettingsError("--prefix-cache-dir", "needs the prefix cache (drop --disable-radix-cache)")
        if Path(settings.prefix_cache_dir).exists() and not Path(settings.prefix_cache_dir).is_dir():
            raise SettingsError("--prefix-cache-dir", f"{settings.prefix_cache_dir} is not a directory")
    if settings.tp_size > 1:
        from dsv4_engine.parallel.shard import check_sizes

        try:
            check_sizes(config, settings.tp_size, settings.ep_size)
        except ValueError as exc:
            flag = "--ep-size" if "ep_size" in str(exc) and settings.ep_size > 1 else "--tp-size"
            raise SettingsError(flag, f"{exc} (in {settings.model})") from exc

    return dataclasses.replace(settings, device=device)
