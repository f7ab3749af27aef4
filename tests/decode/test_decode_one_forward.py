"""Every mode runs the model's one forward: a change to a module's forward (here a forward hook,
standing in for a tensor-parallel all-reduce) reaches the prefill, the reference decode and the
batched decode step alike. Before the one-forward redesign the batched step read the modules'
weights itself, so such a change silently did not run in decode."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.graph_runner import DecodeGraphRunner
from dsv4_engine.kernels import choose_kernels


def _hooks(model, calls: dict[str, int], scale: dict[str, float]):  # type: ignore[no-untyped-def]
    def hook(name: str):  # type: ignore[no-untyped-def]
        def fn(module, args, out):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return out * scale[name]

        return fn

    handles = []
    for layer in model.model.layers:
        handles.append(layer.self_attn.register_forward_hook(hook("attn")))
        handles.append(layer.mlp.register_forward_hook(hook("moe")))
    return handles


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch forms"])
def test_module_forwards_run_in_prefill_and_both_decode_paths(model, make_mem, kernels: bool) -> None:
    layers = len(model.model.layers)
    calls = {"attn": 0, "moe": 0}
    scale = {"attn": 1.0, "moe": 1.0}
    ref, bat = make_mem(), make_mem()
    runner = DecodeGraphRunner(
        model,
        bat.kv,
        bat.req_pool,
        1024,
        buckets=(1, 2),
        mode="eager",
        kernels=choose_kernels("cpu", kernels),
    )
    handles = _hooks(model, calls, scale)
    try:
        prompt = list(range(3, 40))
        first = ref.join(model, "a", prompt)
        bat.join(model, "a", prompt)
        assert calls == {"attn": 2 * layers, "moe": 2 * layers}  # the two prefills
        token = [int(first.argmax())]
        want = ref.decode_reference(model, ["a"], token)
        assert calls == {"attn": 3 * layers, "moe": 3 * layers}
        got = bat.decode_batched(runner, ["a"], token)
        assert calls == {"attn": 4 * layers, "moe": 4 * layers}  # the batched step called them too
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # ...and used what they returned: with every MoE output halved, the same step from the same
        # state moves, in the batched step exactly as in the reference.
        ref2, bat2 = make_mem(), make_mem()
        ref2.join(model, "b", prompt)
        bat2.join(model, "b", prompt)
        scale["moe"] = 0.5
        runner2 = DecodeGraphRunner(
            model,
            bat2.kv,
            bat2.req_pool,
            1024,
            buckets=(1, 2),
            mode="eager",
            kernels=choose_kernels("cpu", kernels),
        )
        halved = bat2.decode_batched(runner2, ["b"], token)
        torch.testing.assert_close(halved, ref2.decode_reference(model, ["b"], token), rtol=1e-5, atol=1e-5)
        assert (halved - got).abs().max() > 1e-3
        ref2.leave("b")
        bat2.leave("b")
    finally:
        for h in handles:
            h.remove()
        ref.leave("a")
        bat.leave("a")
