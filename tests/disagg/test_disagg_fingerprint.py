"""The PD layout fingerprint and the checkpoint digest inside it (engine/dsv4_engine/disagg/fingerprint.py,
checkpoint.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4_engine.disagg.checkpoint import checkpoint_digest, checkpoint_report
from dsv4_engine.disagg.fingerprint import (
    fingerprint_diff,
    fingerprint_id,
    layout_fingerprint,
    prompt_digest,
)
from dsv4_engine.make_tiny import make_tiny
from dsv4_engine.memory.layout import Dsv4MemoryLayout, StateType
from dsv4_engine.memory.pools import Dsv4TokenToKVPool, StateComponent
from dsv4_engine.memory.sizing import PoolSizes

WEIGHTS = "model.safetensors"
# Small sampling parameters so the tiny checkpoint's 20 MB file is mostly unread in sampled mode.
SAMPLED = {"full_threshold": 0, "n_windows": 8, "window_bytes": 4096, "tensor_window": 256}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("fp") / "tiny")


@pytest.fixture(scope="session")
def tiny_digest(tiny: Path) -> str:
    return checkpoint_digest(tiny)


@pytest.fixture
def ckpt(tiny: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint, free to mutate."""
    return Path(shutil.copytree(tiny, tmp_path / "ckpt"))


def _header(path: Path) -> tuple[bytes, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[: 8 + n], json.loads(raw[8 : 8 + n])


# ---------------------------------------------------------------------------------------------------
# Checkpoint digest: full mode


def test_digest_is_stable_and_independent_of_the_path(tiny: Path, tiny_digest: str, ckpt: Path) -> None:
    assert tiny_digest.startswith("exact:")
    assert checkpoint_digest(tiny) == tiny_digest
    assert checkpoint_digest(ckpt) == tiny_digest
    os.utime(ckpt / WEIGHTS, (0, 0))  # mtimes play no part
    assert checkpoint_digest(ckpt) == tiny_digest
    assert checkpoint_digest(ckpt / WEIGHTS) == tiny_digest  # a weight file names its folder


def _flip_weight_byte(ckpt: Path) -> None:
    data = bytearray((ckpt / WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 0x01
    (ckpt / WEIGHTS).write_bytes(data)


def _edit_json(ckpt: Path, name: str, key: str, value: object) -> None:
    doc = json.loads((ckpt / name).read_text())
    doc[key] = value
    (ckpt / name).write_text(json.dumps(doc))


def _add_named_template(ckpt: Path) -> None:
    (ckpt / "additional_chat_templates").mkdir()
    (ckpt / "additional_chat_templates" / "tool.jinja").write_text("{{ tools }}")


MUTATIONS = {
    "weight byte": _flip_weight_byte,
    "tokenizer.json": lambda c: _edit_json(c, "tokenizer.json", "truncation", {"max_length": 7}),
    "chat_template.jinja": lambda c: (c / "chat_template.jinja").write_text("{{ messages }}"),
    "tokenizer_config chat_template": lambda c: _edit_json(c, "tokenizer_config.json", "chat_template", "x"),
    "config.json": lambda c: _edit_json(c, "config.json", "rope_theta", 20000),
    "generation_config.json": lambda c: _edit_json(c, "generation_config.json", "do_sample", True),
    "weight file renamed": lambda c: (c / WEIGHTS).rename(c / "model-00001-of-00001.safetensors"),
    "extra chat template": _add_named_template,
}


@pytest.mark.parametrize("mutate", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_digest_changes_with_any_input(ckpt: Path, tiny_digest: str, mutate) -> None:
    mutate(ckpt)
    assert checkpoint_digest(ckpt) != tiny_digest


def test_files_the_loader_ignores_do_not_count(ckpt: Path, tiny_digest: str) -> None:
    (ckpt / "README.md").write_text("notes")
    (ckpt / "consolidated.safetensors").write_bytes(b"x")  # model.safetensors wins, as in the loader
    assert checkpoint_digest(ckpt) == tiny_digest


# ---------------------------------------------------------------------------------------------------
# Checkpoint digest: sampled mode


def test_sampled_mode_is_stable_and_reads_at_most_its_bound(tiny: Path, ckpt: Path) -> None:
    report = checkpoint_report(tiny, **SAMPLED)
    assert report.digest.startswith("sampled:")
    assert checkpoint_report(ckpt, **SAMPLED).digest == report.digest
    weights = next(f for f in report.files if f.name == WEIGHTS)
    assert weights.source == "sampled"
    raw, header = _header(tiny / WEIGHTS)
    tensors = len(header) - ("__metadata__" in header)
    bound = len(raw) + SAMPLED["n_windows"] * SAMPLED["window_bytes"] + 2 * SAMPLED["tensor_window"] * tensors
    size = (tiny / WEIGHTS).stat().st_size
    assert len(raw) < weights.bytes_read <= bound
    assert bound < size // 10  # a sample indeed, not the file
    # the production defaults keep their documented bound too
    default = next(f for f in checkpoint_report(tiny, full_threshold=0).files if f.name == WEIGHTS)
    assert default.bytes_read <= len(raw) + 64 * (64 << 10) + 2 * (4 << 10) * tensors


def test_sampled_mode_sees_a_perturbed_tensor(tiny: Path, ckpt: Path) -> None:
    tensors = load_file(str(tiny / WEIGHTS))
    name = next(n for n, t in tensors.items() if t.is_floating_point() and t.nbytes > 4 * 256)
    tensors[name] = tensors[name] * 1.01 + 1e-3
    save_file(tensors, str(ckpt / WEIGHTS), metadata={"format": "pt"})
    assert _header(ckpt / WEIGHTS)[0] == _header(tiny / WEIGHTS)[0]  # only the data changed
    assert checkpoint_digest(ckpt, **SAMPLED) != checkpoint_digest(tiny, **SAMPLED)


def test_sampled_mode_sees_a_header_change(tiny: Path, ckpt: Path) -> None:
    data = (ckpt / WEIGHTS).read_bytes()
    assert data.count(b'"format":"pt"') == 1
    (ckpt / WEIGHTS).write_bytes(data.replace(b'"format":"pt"', b'"format":"np"'))  # same length
    assert checkpoint_digest(ckpt, **SAMPLED) != checkpoint_digest(tiny, **SAMPLED)


def test_sampling_parameters_are_part_of_the_digest(tiny: Path) -> None:
    assert checkpoint_digest(tiny, **SAMPLED) != checkpoint_digest(tiny, **{**SAMPLED, "n_windows": 9})


# ---------------------------------------------------------------------------------------------------
# Checkpoint digest: hashes the hub provides


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hub_cache(tiny: Path, root: Path, weight_blob: str | None = None) -> Path:
    """An HF hub cache layout: snapshots/<rev>/<file> -> ../../blobs/<sha256 (LFS) or git sha1>."""
    blobs, snap = root / "blobs", root / "snapshots" / ("ab" * 20)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(tiny.iterdir()):
        data = f.read_bytes()
        blob = _git_blob_sha1(data)
        if f.name == WEIGHTS:
            blob = weight_blob or hashlib.sha256(data).hexdigest()
        (blobs / blob).write_bytes(data)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", blob))
    return snap


def test_hub_cache_blob_name_is_the_weight_hash(tiny: Path, tmp_path: Path, tiny_digest: str) -> None:
    snap = _hub_cache(tiny, tmp_path / "models--org--tiny")
    report = checkpoint_report(snap, **SAMPLED)  # above the threshold, yet exact
    weights = next(f for f in report.files if f.name == WEIGHTS)
    assert (weights.source, weights.bytes_read) == ("hub-blob", 0)
    assert report.digest == tiny_digest  # the same as hashing the bytes in full


def test_hub_cache_blob_name_is_what_counts(tiny: Path, tmp_path: Path, tiny_digest: str) -> None:
    snap = _hub_cache(tiny, tmp_path / "models--org--tiny", weight_blob="0" * 64)
    assert checkpoint_digest(snap) != tiny_digest


def _write_etag(ckpt: Path, name: str, etag: str, written: float) -> None:
    meta = ckpt / ".cache" / "huggingface" / "download" / f"{name}.metadata"
    meta.parent.mkdir(parents=True)
    meta.write_text(f"{'cd' * 20}\n{etag}\n{written}\n")


def test_local_dir_etag_is_used_while_fresh(ckpt: Path, tiny_digest: str) -> None:
    sha = hashlib.sha256((ckpt / WEIGHTS).read_bytes()).hexdigest()
    written = time.time()
    os.utime(ckpt / WEIGHTS, (written - 10, written - 10))  # downloaded, then recorded
    _write_etag(ckpt, WEIGHTS, sha, written)
    report = checkpoint_report(ckpt, **SAMPLED)
    assert next(f.source for f in report.files if f.name == WEIGHTS) == "hub-etag"
    assert report.digest == tiny_digest
    os.utime(ckpt / WEIGHTS, (written + 10, written + 10))  # modified after the record: not trusted
    report = checkpoint_report(ckpt, **SAMPLED)
    assert next(f.source for f in report.files if f.name == WEIGHTS) == "sampled"


def test_a_non_lfs_etag_is_ignored(ckpt: Path) -> None:
    _write_etag(ckpt, WEIGHTS, _git_blob_sha1(b"x"), time.time() + 100)  # a git sha1, not a sha256
    report = checkpoint_report(ckpt, **SAMPLED)
    assert next(f.source for f in report.files if f.name == WEIGHTS) == "sampled"


# ---------------------------------------------------------------------------------------------------
# Layout fingerprint

LAYOUT = Dsv4MemoryLayout(compress_ratios=(0, 4, 128, 4), head_dim=128, index_head_dim=64, window=16)
DIGEST = "exact:" + "1" * 64


def _components(layout: Dsv4MemoryLayout, pages: int = 2) -> list[StateComponent]:
    return Dsv4TokenToKVPool(layout, PoolSizes(pages, pages + 1, pages + 2, pages + 3)).pd_state_components()


def test_fingerprint_ignores_pointers_and_pool_sizes() -> None:
    small, large = _components(LAYOUT, 2), _components(LAYOUT, 5)
    assert small[0].data_lens != large[0].data_lens
    a, b = layout_fingerprint(LAYOUT, small, DIGEST), layout_fingerprint(LAYOUT, large, DIGEST)
    assert a == b and fingerprint_diff(a, b) is None
    assert fingerprint_id(a) == fingerprint_id(b)
    assert len(fingerprint_id(a)) == 16 and int(fingerprint_id(a), 16) >= 0
    assert json.loads(json.dumps(a)) == a  # survives the handshake's JSON
    assert a["state_types"] == ["SWA", "C4", "C128", "INDEXER", "C4_STATE", "C128_STATE"]
    assert a["buffer_counts"] == {"SWA": 4, "C4": 2, "C128": 1, "INDEXER": 2, "C4_STATE": 4, "C128_STATE": 1}


def _fp(layout: Dsv4MemoryLayout = LAYOUT, checkpoint: str = DIGEST) -> dict:
    return layout_fingerprint(layout, _components(layout), checkpoint)


def test_diff_names_the_page_size() -> None:
    other = replace(LAYOUT, page_size=256)
    msg = fingerprint_diff(_fp(), _fp(other))
    assert msg == "layout field 'page_size' differs: this server has 128, the peer has 256"


def test_diff_names_the_dtype() -> None:
    other = replace(LAYOUT, kv_dtype=torch.float16)  # same item lengths
    msg = fingerprint_diff(_fp(), _fp(other))
    assert msg == (
        "layout field 'kv_dtype' differs: this server has torch.bfloat16, the peer has torch.float16"
    )


def test_diff_names_the_item_length() -> None:
    mine = _components(LAYOUT)
    theirs = [
        StateComponent(c.state_type, c.data_ptrs, c.data_lens, [n * 2 for n in c.item_lens])
        if c.state_type == StateType.C4
        else c
        for c in mine
    ]
    mine_fp, theirs_fp = layout_fingerprint(LAYOUT, mine, DIGEST), layout_fingerprint(LAYOUT, theirs, DIGEST)
    n = mine[1].item_lens[0]
    want = f"layout field 'item_lens' differs for C4 at index 0: this server has {n}, the peer has {2 * n}"
    assert fingerprint_diff(mine_fp, theirs_fp) == want


def test_diff_names_the_checkpoint_with_short_digests() -> None:
    theirs = "sampled:" + "2" * 64
    msg = fingerprint_diff(_fp(), _fp(checkpoint=theirs))
    assert msg is not None and msg.startswith("layout field 'checkpoint' differs")
    assert "exact:111111111111," in msg and "sampled:222222222222 " in msg and "1" * 13 not in msg
    assert fingerprint_id(_fp()) != fingerprint_id(_fp(checkpoint=theirs))


def test_diff_names_a_field_one_side_lacks() -> None:
    newer = {**_fp(), "transfer_protocol": "tcp"}
    assert fingerprint_diff(_fp(), newer) == (
        "layout field 'transfer_protocol' is missing on this server (fingerprint version 1 here, 1 there)"
    )


def test_real_checkpoint_fingerprint(tiny: Path, tiny_digest: str) -> None:
    layout = Dsv4MemoryLayout.from_config(json.loads((tiny / "config.json").read_text()))
    fp = layout_fingerprint(layout, _components(layout), tiny_digest)
    assert fp["compress_ratios"] == [0, 4, 128, 4] and fp["checkpoint"] == tiny_digest


# ---------------------------------------------------------------------------------------------------
# Prompt digest


def test_prompt_digest() -> None:
    ids = [0, 5, 17, 511, 3]
    assert prompt_digest(ids) == prompt_digest(tuple(ids)) == prompt_digest(torch.tensor(ids).tolist())
    assert len(prompt_digest(ids)) == 32
    others = [ids[:-1], [*ids, 0], list(reversed(ids)), [], [2**40]]
    assert len({prompt_digest(x) for x in [ids, *others]}) == 1 + len(others)


# ---------------------------------------------------------------------------------------------------
# Pairing across versions


@pytest.mark.parametrize("decode_ranks", [1, 2])
def test_a_parallel_decode_refuses_a_prefill_from_before_per_rank_transfer(decode_ranks: int) -> None:
    """A prefill whose /route lists no ranks writes decode rank 0 only: a 2-rank decode refuses it
    before registering, naming why; a 1-rank decode registers as before (the pair works either way)."""
    import asyncio
    from types import SimpleNamespace

    import httpx

    from dsv4_engine.disagg.decode_peers import PrefillPeer, PrefillPeers
    from dsv4_engine.disagg.protocol import PdError

    registered: list[dict[str, Any]] = []

    def old_prefill(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/route":
            return httpx.Response(200, json={"fingerprint": _fp(), "instance": "old"})
        registered.append(json.loads(request.content))
        return httpx.Response(200, json={"status": "ok"})

    session: dict[str, Any] = {"mooncake_session": "127.0.0.1:1", "fingerprint": _fp()}
    if decode_ranks > 1:
        session["ranks"] = [{"rank": 1, "mooncake_session": "127.0.0.1:2", "dst_ptrs": {}}]
    metrics = SimpleNamespace()
    peers = PrefillPeers(
        "d",
        session,
        fingerprint=_fp(),
        heartbeat_interval=1.0,
        heartbeat_failures=3,
        metrics=metrics,  # type: ignore[arg-type]
    )

    async def register() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(old_prefill), base_url="http://p")
        async with client:
            await peers._register(PrefillPeer("p:1", client))

    if decode_ranks == 1:
        asyncio.run(register())
        assert registered == [session]
        return
    with pytest.raises(PdError) as err:
        asyncio.run(register())
    assert err.value.reason == "layout_mismatch" and "predates per-rank transfer" in err.value.message
    assert registered == []
