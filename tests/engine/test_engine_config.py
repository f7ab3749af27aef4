"""EngineConfig: every engine setting resolved once, and what cannot work rejected naming the setting."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.engine_config import DEFAULT_MAX_MODEL_LEN, EngineConfig


def build(**kw: object) -> EngineConfig:
    return EngineConfig.build("/ckpt", "float32", "cpu", max_position_embeddings=4096, **kw)  # type: ignore[arg-type]


def test_defaults_resolve_against_the_checkpoint_and_the_page() -> None:
    cfg = build()
    assert cfg.device == torch.device("cpu") and cfg.dtype == torch.float32
    assert cfg.max_model_len == min(DEFAULT_MAX_MODEL_LEN, 4096) == 4096  # the checkpoint caps it
    assert cfg.chunked_prefill_size == cfg.page_size == 128  # one page
    assert cfg.max_num_batched_tokens == 2048
    assert build(max_model_len=1000).max_model_len == 1000


def test_an_unlimited_chunk_and_a_large_one_set_the_budget() -> None:
    assert build(chunked_prefill_size=-1).chunked_prefill_size is None
    big = build(chunked_prefill_size=4096)
    assert big.chunked_prefill_size == 4096 and big.max_num_batched_tokens == 4096  # a chunk fits a step
    assert build(chunked_prefill_size=4096, max_num_batched_tokens=8192).max_num_batched_tokens == 8192


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"chunked_prefill_size": 100}, "chunked_prefill_size"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"num_pages": 0}, "num_pages"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"page_size": 0}, "page_size"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": 4, "ep_size": 3}, "ep_size 3 must divide tp_size 4"),
    ],
)
def test_what_cannot_work_is_rejected_by_name(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build(**kw)


def test_the_scheduler_and_runner_read_their_part() -> None:
    cfg = build(max_num_seqs=8, chunked_prefill_size=256, enforce_eager=False, kernels=False)
    sched = cfg.scheduler_config((1,))
    assert (sched.page_size, sched.max_model_len, sched.max_num_seqs, sched.chunk_size, sched.eos_token_ids) == (
        128, 4096, 8, 256, (1,),
    )  # fmt: skip
    assert sched.max_num_batched_tokens == cfg.max_num_batched_tokens
    assert sched.num_draft_tokens == 0
    assert cfg.runner_options() == {
        "enforce_eager": False, "max_num_seqs": 8, "kernels": False, "num_draft_tokens": 0,
    }  # fmt: skip


def test_speculative_decoding_options() -> None:
    """--speculative-num-steps alone, --speculative-algorithm alone (SGLang's default recipe: 3),
    both (the steps win), 0 (off), and what the engine refuses, naming the option."""
    assert build().speculative_num_steps == 0
    assert build(speculative_num_steps=2).speculative_num_steps == 2
    assert build(speculative_algorithm="NEXTN").speculative_num_steps == 3
    assert build(speculative_algorithm="EAGLE", speculative_num_steps=1).speculative_num_steps == 1
    assert build(speculative_algorithm="MTP", speculative_num_steps=0).speculative_num_steps == 0
    cfg = build(speculative_num_steps=2)
    assert cfg.scheduler_config(()).num_draft_tokens == cfg.runner_options()["num_draft_tokens"] == 2
    with pytest.raises(ValueError, match="speculative_num_steps must be >= 0"):
        build(speculative_num_steps=-1)
    with pytest.raises(ValueError, match="NEXTN, EAGLE, MTP"):
        build(speculative_algorithm="medusa")
    assert build(speculative_algorithm="nextn").speculative_num_steps == 3
    assert build(speculative_num_steps=2, tp_size=2).speculative_num_steps == 2  # every rank drafts


def test_kernels_default_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSV4_KERNELS", raising=False)
    assert build().kernels is True
    monkeypatch.setenv("DSV4_KERNELS", "0")
    assert build().kernels is False
    assert build(kernels=True).kernels is True  # an engine's own setting wins


def test_an_engine_without_kernels_never_reaches_them(make_llm) -> None:
    """kernels=False reaches every kind of step: no `dsv4::` op is dispatched (the modules and the
    decode attention backend take their torch forms), while the kernel engine dispatches them; the
    greedy output is the kernel engine's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dsv4_engine.sampling_params import SamplingParams

    class Kernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.namespace == "dsv4":
                self.seen.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    prompt = [list(range(5, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with_kernels = make_llm("A", kernels=True)
    with Kernels() as seen:
        want = with_kernels.generate(prompt, params)[0].token_ids
    assert {"hc_pre", "moe_experts", "linear", "paged_attention", "fill_decode"} <= seen.seen, seen.seen

    llm = make_llm("A", kernels=False)
    runner = llm.engine.runner
    assert runner.kernels.name == "torch"
    assert runner.decode_runner().kernels.name == "torch"
    with Kernels() as seen:
        assert llm.generate(prompt, params)[0].token_ids == want
    assert not seen.seen, seen.seen
