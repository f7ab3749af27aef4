"""The engine's options, each declared once: name, type, default, help, and the check it must pass.

`LLMEngine(...)` and `LLM(...)` take them as keyword arguments, `EngineConfig.build` resolves them,
and `dsv4 serve` has one flag for each option that declares `flags` (`add_flags`); `ServerSettings`
is an `EngineOptions` with the server's settings added. An option left at None is the engine's to
decide: `EngineConfig.build` resolves it against the checkpoint, the page size and the memory, with the
DEFAULT_* numbers below (which the flags' help quotes).

`model_path`, `dtype` and `device` are not options: they are the engine's positional arguments, and
`dsv4 serve` declares `--model`, `--dtype` and `--device` itself (its `--device` defaults to `auto`).

This module imports no torch: the operator's tests parse `dsv4 serve` command lines with it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_MAX_MODEL_LEN = 16384  # caps the RoPE tables; the real model allows 1M positions
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_PAGE_SIZE = 128
# Per-request prefill chunk when none is given: one page. Attention runs in query blocks over the
# window keys each block can see, so its cost per token hardly depends on the chunk (on the small
# preset, CPU, 1 and 2 pages prefill equally fast, 4 pages ~5% slower); many requests' chunks still
# share one forward, so the linear layers see the whole token budget.
DEFAULT_CHUNK_PAGES = 1
# Without an explicit budget the pools take at most this share of the memory available at start
# (host memory on CPU, free device memory otherwise), and never more than max_num_seqs full contexts.
DEFAULT_MEMORY_FRACTION = {"cpu": 0.25}
DEFAULT_DEVICE_MEMORY_FRACTION = 0.8
UNLIMITED_CHUNK = -1  # chunked_prefill_size: chunks limited by the token budget only
# Draft tokens per step when --speculative-algorithm is given alone (SGLang's DeepSeek MTP recipes
# run 1 to 3 steps with top-1 drafts).
DEFAULT_SPECULATIVE_NUM_STEPS = 3
# The draft model each --speculative-algorithm name means: the checkpoint's MTP layer (SGLang calls
# DeepSeek's MTP "NEXTN" and runs it through its EAGLE worker).
SPECULATIVE_ALGORITHMS = ("NEXTN", "EAGLE", "MTP")


# ---- a flag's text -> its value (argparse's `type`; ArgumentTypeError becomes a usage error) --------
def at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {text}")
        return value

    return parse


def positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def chunk_size(text: str) -> int:
    value = int(text)
    if value != UNLIMITED_CHUNK and value <= 0:
        raise argparse.ArgumentTypeError(f"must be -1 (no per-request cap) or positive, got {text}")
    return value


_IEC = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def speculative_algorithm(text: str) -> str:
    name = text.strip().upper()
    if name not in SPECULATIVE_ALGORITHMS:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(SPECULATIVE_ALGORITHMS)} (the checkpoint's MTP layer), got {text!r}"
        )
    return name


def byte_count(text: str) -> int:
    """A byte count, optionally with an IEC suffix (`8Gi`, `512MiB`): SI and bare-letter suffixes
    mean different things in different vLLM releases, so they are refused rather than guessed."""
    m = re.fullmatch(r"(\d+)(?:(Ki|Mi|Gi|Ti)B?)?", text.strip())
    if m is None or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive byte count, optionally with Ki/Mi/Gi/Ti; got {text!r}"
        )
    return int(m.group(1)) * _IEC[m.group(2) or ""]


# ---- the declaration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """What an option's field carries besides its name, type and default."""

    help: str
    flags: tuple[str, ...] = ()  # `dsv4 serve`'s spellings, its own first; none: not a flag
    parse: Callable[[str], Any] | None = None  # a flag's text -> value; default: by `minimum`
    minimum: int | None = None  # the least value the engine and the flag accept (None always passes)

    def parser(self) -> Callable[[str], Any] | None:
        if self.parse is None and self.minimum == 1:
            return positive(int)
        return self.parse


def option(
    default: Any,
    *flags: str,
    help: str,
    parse: Callable[[str], Any] | None = None,
    minimum: int | None = None,
) -> Any:
    return field(default=default, metadata={"spec": Spec(help, flags, parse, minimum)})


@dataclass(kw_only=True)
class EngineOptions:
    """What one engine is asked to be; None: the engine decides (see `EngineConfig.build`)."""

    page_size: int | None = option(
        None,
        "--page-size",
        "--block-size",  # vLLM's spelling
        minimum=1,
        help=f"tokens per KV page (default: the engine's, {DEFAULT_PAGE_SIZE})",
    )
    max_model_len: int | None = option(
        None,
        "--max-model-len",
        "--context-length",  # SGLang's spelling
        minimum=1,
        help=f"context length, prompt plus completion (default: the engine's, {DEFAULT_MAX_MODEL_LEN}, "
        "capped by the checkpoint's max_position_embeddings)",
    )
    chunked_prefill_size: int | None = option(
        None,
        "--chunked-prefill-size",
        parse=chunk_size,
        help="per-request prefill chunk in tokens, a multiple of --page-size; -1: no per-request cap, a "
        "prompt is then split only where it exceeds a step's --max-num-batched-tokens "
        "(default: one page)",
    )
    max_num_seqs: int | None = option(
        None,
        "--max-num-seqs",
        "--max-running-requests",  # SGLang's spelling
        minimum=1,
        help=f"requests running at once (default: the engine's, {DEFAULT_MAX_NUM_SEQS})",
    )
    max_num_batched_tokens: int | None = option(
        None,
        "--max-num-batched-tokens",
        minimum=1,
        help="tokens one engine step may process, decodes plus prefill chunks, as vLLM's flag "
        f"(default: the engine's, {DEFAULT_MAX_NUM_BATCHED_TOKENS}, or the chunk size if larger)",
    )
    num_pages: int | None = option(
        None,
        "--num-pages",
        minimum=1,
        help="full pages (page-size tokens each) for the KV pools instead of a share of free memory "
        "(default: sized from memory)",
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        "--kv-cache-memory-bytes",
        parse=byte_count,
        help="bytes for the KV pools (e.g. 8Gi), as vLLM's flag, instead of a share of the memory free "
        "at start; not with --num-pages (default: a quarter of available host memory on CPU, 0.8 of "
        "free device memory otherwise, at most --max-num-seqs full contexts)",
    )
    enforce_eager: bool = option(
        True,
        "--enforce-eager",  # and --no-enforce-eager
        help="decode eagerly (default); --no-enforce-eager compiles (CPU) or captures (GPU/NPU) a "
        "decode step per batch-size bucket up to --max-num-seqs at start-up, before serving",
    )
    tp_size: int = option(
        1,
        "--tp-size",
        "--tensor-parallel-size",  # SGLang's and vLLM's spelling
        "--tp",
        "-tp",  # vLLM's short form
        minimum=1,
        help="tensor-parallel size: this many processes, one per rank (gloo on CPU, HCCL on NPU, NCCL "
        "on GPU); query heads, output projections and experts are split, the latent replicated",
    )
    ep_size: int = option(
        1,
        "--ep-size",
        "--expert-parallel-size",
        "--ep",  # SGLang's spelling
        minimum=1,
        help="expert-parallel size (divides --tp-size): routed experts split this many ways, each "
        "expert's intermediate size --tp-size / --ep-size ways",
    )
    disable_radix_cache: bool = option(
        False,
        "--disable-radix-cache",  # SGLang's spelling
        help="no prefix cache: every request prefills its whole prompt (default: a request resumes "
        "from the longest cached page-aligned prefix of its prompt, SGLang's radix cache)",
    )
    speculative_algorithm: str | None = option(
        None,
        "--speculative-algorithm",  # SGLang's spelling
        parse=speculative_algorithm,
        help="speculative decoding with the checkpoint's MTP layer as the draft model: NEXTN (SGLang's "
        f"name; EAGLE and MTP mean the same here); alone it drafts {DEFAULT_SPECULATIVE_NUM_STEPS} "
        "tokens a step (default: off)",
    )
    speculative_num_steps: int | None = option(
        None,
        "--speculative-num-steps",  # SGLang's spelling
        minimum=0,
        parse=at_least(0),
        help="draft tokens the MTP layer proposes per decode step, all verified by one forward; "
        "0 turns speculative decoding off (default: off, or "
        f"{DEFAULT_SPECULATIVE_NUM_STEPS} with --speculative-algorithm)",
    )
    kernels: bool | None = option(
        None,
        help="whether this engine uses the fused kernels (dsv4_engine.kernels: the CPU kernels on CPU, "
        "torch_npu's ops on NPU; None: on unless DSV4_KERNELS=0); engines in one process may differ",
    )
    prewarm: bool = option(
        True,
        help="one collective per process group before serving (parallel.groups.prewarm); off only to "
        "measure what it saves (bench/parallel.py)",
    )

    def check(self) -> None:
        """Raise ValueError naming an option the engine cannot take whatever else is set."""
        for f in fields(EngineOptions):
            value, least = getattr(self, f.name), f.metadata["spec"].minimum
            if least is not None and value is not None and value < least:
                raise ValueError(f"{f.name} must be >= {least}, got {value}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} must divide tp_size {self.tp_size}")
        algorithm = self.speculative_algorithm
        if algorithm is not None and algorithm.strip().upper() not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)} (the "
                f"checkpoint's MTP layer), got {algorithm!r}"
            )

    def num_draft_tokens(self) -> int:
        """Draft tokens per step: 0 when speculative decoding is off."""
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        return DEFAULT_SPECULATIVE_NUM_STEPS if self.speculative_algorithm is not None else 0

    def explicit(self) -> dict[str, Any]:
        """The options set to something other than their default: what to pass on to an engine."""
        return {
            f.name: getattr(self, f.name) for f in fields(EngineOptions) if getattr(self, f.name) != f.default
        }


NAMES = frozenset(f.name for f in fields(EngineOptions))


def split(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the engine options among `kwargs`, everything else)."""
    known = {k: v for k, v in kwargs.items() if k in NAMES}
    return known, {k: v for k, v in kwargs.items() if k not in NAMES}


def flags() -> dict[str, str]:
    """Each option that is a `dsv4 serve` flag -> its own spelling."""
    return {f.name: f.metadata["spec"].flags[0] for f in fields(EngineOptions) if f.metadata["spec"].flags}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option that has `flags`, defaulting to the option's default (None: not given)."""
    for f in fields(EngineOptions):
        s: Spec = f.metadata["spec"]
        if not s.flags:
            continue
        if isinstance(f.default, bool):  # a switch: --x and --no-x
            action = argparse.BooleanOptionalAction
            parser.add_argument(*s.flags, dest=f.name, action=action, default=f.default, help=s.help)
        else:
            parser.add_argument(*s.flags, dest=f.name, type=s.parser(), default=f.default, help=s.help)
