"""The engine's MTP layer (model/mtp.py, run by the drafter over its ring) computes what the plain-torch
reference on HF's own decoder layer computes (dsv4_engine.mtp_layer.mtp_reference_logits): for every
position i of a prompt, the logits of t_{i+2} from the target's streams at i and t_{i+1}."""

from __future__ import annotations

import torch

from dsv4_engine.config import Dsv4Config
from dsv4_engine.demo import bundled
from dsv4_engine.kernels import choose_kernels
from dsv4_engine.loader import load_checkpoint
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
from dsv4_engine.mtp_layer import mtp_reference_logits
from dsv4_engine.speculative import DraftCache, Drafter, DraftRow
from dsv4_engine.testing import dense_cache, random_ids


def test_engine_mtp_logits_equal_the_reference() -> None:
    demo = bundled()
    ids = random_ids(70, seed=9, vocab=1000)  # past the demo's 16-token window
    model = Dsv4ForCausalLM(Dsv4Config.from_pretrained(demo), max_positions=256, mtp=True).cast(torch.float32)
    load_checkpoint(model, demo, dtype=None, progress=False)
    model.eval()
    kernels = choose_kernels("cpu")
    with torch.inference_mode():
        batch = ForwardBatch.build([(dense_cache(model), ids)], kernels=kernels)
        streams = model.model.streams(batch)
        # A ring long enough for the whole prompt: every row's window is then in it, not only the last's.
        window, dim = model.config.sliding_window, model.config.head_dim
        shape = (model.config.hc_mult, model.config.hidden_size)
        cache = DraftCache(1, window, len(ids), dim, torch.float32, torch.device("cpu"), stream_shape=shape)
        drafter = Drafter(model, cache, 1, kernels)
        row = DraftRow("r", 0, 0, 0, ids[1:], draft=False, window_from=0)
        out = drafter._pass([(row, 0, ids[1:])], streams[:-1])
        got = model.compute_logits(drafter.mtp.hidden(out, drafter.kernels), kernels)
        # The engine's ring (k = 1: window + 3 positions) over the same pass: only each row's last
        # positions are written, and the last position, the one that drafts, sees its whole window.
        ring = DraftCache(1, window, 1, dim, torch.float32, torch.device("cpu"), stream_shape=shape)
        small = Drafter(model, ring, 1, kernels)
        last = small._pass([(row, 0, ids[1:])], streams[:-1])[-1:]
        last_logits = model.compute_logits(small.mtp.hidden(last, small.kernels), kernels)
    want = mtp_reference_logits(demo, ids)
    torch.testing.assert_close(last_logits, want[-1:], atol=2e-4, rtol=1e-4)
    assert got.shape == want.shape == (len(ids) - 1, model.config.vocab_size)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
