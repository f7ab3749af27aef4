"""Projections that read the same input, packed into one weight matrix for the decode step.

A decode step is a chain of small GEMVs, each paying a dispatch (eager) or a BLAS call (compiled);
attention's input alone feeds up to seven (q_a, kv, the compressor's and the indexer's kv and gate,
the indexer's head weights). `pack_linears` concatenates their weights once and makes each original
weight a view of its rows, so the packed matrix costs no memory, the modules and their state-dict
names stay as they are, and one GEMM serves all of them. Like a captured graph, the packing holds
the weights' storage: build it after the model is loaded, cast and moved, and again if it ever is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from dsv4_engine.kernels import KernelSet


@dataclass(frozen=True)
class Packed:
    weight: torch.Tensor  # [sum of outputs, in]
    sizes: tuple[int, ...]

    def __call__(self, x: torch.Tensor, kernels: KernelSet) -> tuple[torch.Tensor, ...]:
        """The projections of x, as one GEMM (the set's `linear`)."""
        return kernels.linear(x, self.weight).split(self.sizes, dim=-1)


def _still_packed(pack: Packed, linears: list[nn.Linear]) -> bool:
    """Whether every weight is still the view of its rows (nothing re-cast, moved or replaced it)."""
    ptr, start = pack.weight.data_ptr(), 0
    for m in linears:
        if m.weight.data_ptr() != ptr + start * pack.weight.stride(0) * pack.weight.element_size():
            return False
        start += m.weight.shape[0]
    return True


def pack_linears(linears: list[nn.Linear]) -> Packed:
    """One GEMM for `linears` (same input width and dtype, no bias); their weights become views."""
    if len({(m.in_features, m.weight.dtype, m.weight.device) for m in linears}) != 1:
        raise ValueError("packed projections need one input width, dtype and device")
    if any(m.bias is not None for m in linears):
        raise ValueError("packed projections have no bias")
    weight = torch.cat([m.weight.detach() for m in linears])
    start = 0
    with torch.no_grad():
        for m in linears:
            rows = m.weight.shape[0]
            view = weight[start : start + rows]  # a contiguous view: the packed rows
            # `set_`, a metadata op every backend has (`.data =` needs the same tensor type on both sides).
            m.weight.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
            start += rows
    return Packed(weight, tuple(m.weight.shape[0] for m in linears))


def attention_inputs(attn: nn.Module) -> list[nn.Linear]:
    """Every projection of the attention block's input, in the order the decode step unpacks them:
    q_a, kv, then (ratio > 0) the compressor's kv and gate, then (ratio 4) the indexer's kv, gate and
    head weights."""
    out = [attn.q_a_proj, attn.kv_proj]
    comp = attn.compressor
    if comp is not None:
        out += [comp.kv_proj, comp.gate_proj]
        indexer = getattr(comp, "indexer", None)
        if indexer is not None:
            out += [indexer.kv_proj, indexer.gate_proj, indexer.scorer.weights_proj]
    return out


def decode_packs(model: nn.Module) -> list[tuple[Packed, Packed]] | None:
    """Per layer: (attention input projections, shared expert gate + up), packed once per model and
    reused while the weights are still views of the packed matrices; None when a projection is int8
    (W8A8 on NPU: each runs its own `quant_linear`)."""
    if any(p.dtype == torch.int8 for p in model.parameters()):
        return None
    groups = [
        (
            attention_inputs(layer.self_attn),
            [layer.mlp.shared_experts.gate_proj, layer.mlp.shared_experts.up_proj],
        )
        for layer in model.model.layers
    ]
    packs = getattr(model, "_decode_packs", None)
    if packs is None or not all(
        _still_packed(pack, linears)
        for pair, group in zip(packs, groups, strict=True)
        for pack, linears in zip(pair, group, strict=True)
    ):
        packs = [(pack_linears(attn), pack_linears(shared)) for attn, shared in groups]
        object.__setattr__(model, "_decode_packs", packs)  # a plain attribute: not a submodule or buffer
    return packs
