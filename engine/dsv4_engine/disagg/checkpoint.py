"""The checkpoint digest: one string that changes when the weights, the tokenizer, the chat template
or the config change, part of the PD layout fingerprint (fingerprint.py).

It is computed from the files, never from loaded tensors, so it is the same on every rank and at
every parallel size; it ignores paths, mtimes and the node holding the copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_engine.loader import INDEX_FILE, SINGLE_FILE, CheckpointError

# Small files that change what the model computes or how text becomes tokens; hashed in full.
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
EXTRA_TEMPLATES_DIR = "additional_chat_templates"  # transformers 5: named templates, one .jinja each

# Production defaults of the weight digest (see checkpoint_report).
FULL_THRESHOLD = 4 << 30
N_WINDOWS = 64
WINDOW_BYTES = 64 << 10
TENSOR_WINDOW = 4 << 10

READ_BUFFER = 16 << 20
MAX_HEADER = 100_000_000  # the safetensors format's own cap on the header
HASH_THREADS = 16  # weight files are hashed in parallel: sampled reads are latency-bound
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileDigest:
    """One file of the checkpoint.

    kind is "sha256" (value = the content's sha256, however obtained) or "sampled"; source says how it
    was obtained: "hub-blob", "hub-etag", "full" or "sampled". Only name, kind and value enter the digest,
    so a hub-provided hash and a computed one agree.
    """

    name: str
    kind: str
    value: str
    source: str
    bytes_read: int


@dataclass(frozen=True)
class CheckpointDigest:
    digest: str
    files: tuple[FileDigest, ...]

    @property
    def exact(self) -> bool:
        return all(f.kind == "sha256" for f in self.files)

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files)


# ---------------------------------------------------------------------------------------------------
# Which files


def _weight_files(path: Path) -> tuple[Path, list[Path]]:
    """(checkpoint dir, weight files) as the loader would read them (loader.checkpoint_files)."""
    if path.is_file():
        return path.parent, [path]
    index = path / INDEX_FILE
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return path, [path / n for n in names]
    if (path / SINGLE_FILE).exists():
        return path, [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors checkpoint in {path} (looked for {INDEX_FILE}, {SINGLE_FILE})")
    return path, files


def _small_files(root: Path) -> list[Path]:
    found = [root / n for n in SMALL_FILES if (root / n).is_file()]
    return found + sorted((root / EXTRA_TEMPLATES_DIR).glob("*.jinja"))


def _rel(root: Path, path: Path) -> str:
    # '/'-separated and relative, so the digest does not depend on where the copy lives
    return path.relative_to(root).as_posix()


# ---------------------------------------------------------------------------------------------------
# Exact hashes the Hugging Face hub gives for free


def _hub_blob_sha256(path: Path) -> str | None:
    """The sha256 an HF hub cache names a blob by: snapshots/<rev>/<file> is a link to blobs/<sha256>.

    Only LFS files (the weights) are named by sha256; small files are named by their git sha1 (40 hex),
    which this ignores.
    """
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and _SHA256.fullmatch(target.name):
        return target.name
    return None


def _hub_etag_sha256(root: Path, rel: str) -> str | None:
    """The etag `huggingface-cli download --local-dir` recorded, if it still describes the file.

    The metadata file, .cache/huggingface/download/<file>.metadata, holds three lines: commit hash, etag
    (the sha256 for LFS files) and the time it was written. huggingface_hub trusts it while the file's
    mtime is at most a second past that time; so does this. Read here rather than through huggingface_hub,
    whose reader takes a lock and creates or deletes files in the checkpoint folder (maybe read-only).
    """
    meta = root / ".cache" / "huggingface" / "download" / f"{rel}.metadata"
    try:
        lines = meta.read_text().splitlines()
        etag, written = lines[1].strip().strip('"'), float(lines[2])
        fresh = (root / rel).stat().st_mtime - 1 <= written
    except (OSError, IndexError, ValueError):
        return None
    return etag if fresh and _SHA256.fullmatch(etag) else None


def _free_sha256(root: Path, path: Path) -> FileDigest | None:
    rel = _rel(root, path)
    if sha := _hub_blob_sha256(path):
        return FileDigest(rel, "sha256", sha, "hub-blob", 0)
    if sha := _hub_etag_sha256(root, rel):
        return FileDigest(rel, "sha256", sha, "hub-etag", 0)
    return None


# ---------------------------------------------------------------------------------------------------
# Hashing content


def _full_sha256(root: Path, path: Path) -> FileDigest:
    h, buf, total = hashlib.sha256(), bytearray(READ_BUFFER), 0
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            total += n
    return FileDigest(_rel(root, path), "sha256", h.hexdigest(), "full", total)


def _read_header(fd: int, size: int, path: Path) -> tuple[bytes, dict[str, Any]]:
    """The safetensors header: 8 bytes of little-endian length, then that many bytes of JSON."""
    head = os.pread(fd, 8, 0)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
    if n > MAX_HEADER or 8 + n > size:
        raise CheckpointError(f"{path} is not a safetensors file (header length {n}, file size {size})")
    raw = head + os.pread(fd, n, 8)
    try:
        return raw, json.loads(raw[8:])
    except ValueError as e:
        raise CheckpointError(f"{path} has an unreadable safetensors header: {e}") from e


def _sample_spans(
    header: dict[str, Any], data_start: int, size: int, n_windows: int, window: int, tensor_window: int
) -> list[tuple[int, int]]:
    """Merged (offset, length) spans to read: even windows over the data, and each tensor's ends."""
    data_len = size - data_start
    if data_len <= n_windows * window:
        return [(data_start, data_len)] if data_len else []
    last = data_len - window
    spans = [(data_start + i * last // max(n_windows - 1, 1), window) for i in range(n_windows)]
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = (data_start + int(o) for o in entry["data_offsets"])
        spans.append((begin, min(end - begin, tensor_window)))
        if end - begin > tensor_window:
            spans.append((end - tensor_window, tensor_window))
    return _merge(sorted(s for s in spans if s[1] > 0))


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, length in spans:
        if out and start <= out[-1][0] + out[-1][1]:
            prev_start, prev_len = out[-1]
            out[-1] = (prev_start, max(prev_len, start + length - prev_start))
        else:
            out.append((start, length))
    return out


def _sampled(root: Path, path: Path, n_windows: int, window: int, tensor_window: int) -> FileDigest:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        raw, header = _read_header(fd, size, path)
        h = hashlib.sha256(b"dsv4-sampled-v1\0%d\0%d\0%d\0%d\0" % (size, n_windows, window, tensor_window))
        h.update(raw)
        total = len(raw)
        for start, length in _sample_spans(header, len(raw), size, n_windows, window, tensor_window):
            chunk = os.pread(fd, length, start)
            h.update(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    return FileDigest(_rel(root, path), "sampled", h.hexdigest(), "sampled", total)


# ---------------------------------------------------------------------------------------------------
# The checkpoint digest


def checkpoint_report(
    model_path: str | Path,
    *,
    full_threshold: int = FULL_THRESHOLD,
    n_windows: int = N_WINDOWS,
    window_bytes: int = WINDOW_BYTES,
    tensor_window: int = TENSOR_WINDOW,
) -> CheckpointDigest:
    """Digest the checkpoint at `model_path` (a folder, or one .safetensors file); see checkpoint_digest.

    Small files (config, generation config, shard index, tokenizer files, chat templates: SMALL_FILES
    and additional_chat_templates/*.jinja) are hashed in full. Each weight file gets, in order of
    preference:

    1. its sha256 from the hub, read for free: the blob name an HF hub cache links it to, or the etag
       `huggingface-cli download --local-dir` recorded, while the file is not newer than that record;
    2. its sha256 computed in full, when the weight files without (1) total at most `full_threshold`
       bytes (4 GiB: exact for small models, a few seconds of reading);
    3. otherwise a sampled digest: the file size, its whole safetensors header (every tensor's name,
       dtype, shape and offsets), `n_windows` windows of `window_bytes` spread evenly over the data,
       and the first and last `tensor_window` bytes of every tensor. It reads at most
       8 + header + n_windows * window_bytes + 2 * tensor_window * tensors bytes per file (and never more
       than the file): with the defaults, header + 4 MiB + 8 KiB per tensor, about 9 MiB for a 4 GB
       shard of 600 tensors. A 150 GB checkpoint in 40 shards with 100k tensors reads under 1 GB, by 16
       threads: seconds.

    Exact and sampled digests differ in kind: (1) and (2) give the same value for the same bytes.

    What the sampled mode cannot see: a change confined to bytes it does not read, i.e. one that keeps
    every tensor's name, dtype, shape, first and last 4 KiB and the 64 sampled windows. That is
    acceptable because what really produces different weights of one shape -- a fine-tune, a merged
    adapter, a re-quantisation, another revision -- changes every tensor it touches throughout, its
    ends included; a hand edit of a few bytes mid-tensor is not something a rollout does. Whenever the
    hub provides an exact hash it is used instead. A copy that lost its hub records and exceeds the
    threshold gets a sampled digest that differs from an exact one for the same bytes: the servers then
    refuse to pair (safe, and the digest's "exact:"/"sampled:" prefix shows why).
    """
    root, weights = _weight_files(Path(model_path))
    small = [_full_sha256(root, p) for p in _small_files(root)]
    free = {p: _free_sha256(root, p) for p in weights}
    rest = [p for p in weights if free[p] is None]
    full = sum(p.stat().st_size for p in rest) <= full_threshold

    def digest(p: Path) -> FileDigest:
        if full:
            return _full_sha256(root, p)
        return _sampled(root, p, n_windows, window_bytes, tensor_window)

    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(rest)))) as pool:
        computed = dict(zip(rest, pool.map(digest, rest), strict=True))
    files = tuple(sorted([*small, *(free[p] or computed[p] for p in weights)], key=lambda f: f.name))
    return CheckpointDigest(_combine(files), files)


def _combine(files: tuple[FileDigest, ...]) -> str:
    h = hashlib.sha256(b"dsv4-checkpoint-v1\n")
    for f in files:
        h.update(f"{f.name}\t{f.kind}\t{f.value}\n".encode())
    kind = "exact" if all(f.kind == "sha256" for f in files) else "sampled"
    return f"{kind}:{h.hexdigest()}"


def checkpoint_digest(model_path: str | Path, **options: int) -> str:
    """A digest of the checkpoint's weights, tokenizer, chat template and config: "exact:<hex>" or
    "sampled:<hex>". Options (thresholds, window sizes) as in checkpoint_report, for tests."""
    return checkpoint_report(model_path, **options).digest
