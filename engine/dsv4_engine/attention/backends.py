"""The batched decode step's attention backends (`paged_decode.AttentionBackend`): what differs
between the torch forms and the CPU kernels in attention over the pools, the pool writes included.

`TorchAttention` is the torch forms of `paged_decode`, which a compiler fuses and a device graph
captures (CUDA and NPU take it; their own fused kernels plug in the same way). `CpuKernelAttention`
runs each as one `dsv4::` kernel that reads the pools in place (`kernels/attention.cpp`); under a
compiler it keeps only the compressor kernel, which pools just the rows completing a block where the
static torch form pools every row, every step, and leaves the rest to the compiler to fuse. The
kernels are fp32 loops: other dtypes take the torch forms.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import kernels
from ..model.attention import Dsv4Attention
from ..model.compressor import Compressor, Indexer
from . import paged_decode
from .metadata import CompressMetadata


class TorchAttention:
    def masked_put(
        self, pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
    ) -> None:
        """pool[slots] = rows where mask, else the KV sentinel (0) into slot 0 (which it already holds)."""
        keep = mask[:, None]
        pool.index_put_((torch.where(mask, slots, 0),), torch.where(keep, rows.to(pool.dtype), 0.0))

    def attend(
        self, attn: Dsv4Attention, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Softmax over [keys | sink] per head; `q [B, H, D]`, `keys [B, K, D]`, `bias [B, K]`."""
        logits = torch.matmul(q, keys.transpose(1, 2)) * attn.scaling + bias[:, None, :].to(q.dtype)
        sinks = attn.sinks.view(1, -1, 1).expand(q.shape[0], -1, 1)
        logits = torch.cat([logits, sinks], dim=-1)  # sinks are fp32: promotes like the reference
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys)  # [B, H, D]

    # The torch forms themselves (backend first).
    compress = paged_decode.compress_decode
    index_topk = paged_decode.index_topk
    paged_attend = paged_decode.paged_attend


class CpuKernelAttention(TorchAttention):
    def masked_put(
        self, pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
    ) -> None:
        if (k := _eager()) is None:
            return super().masked_put(pool, slots, rows, mask)
        k.masked_put(pool, slots, rows, mask)

    def attend(
        self, attn: Dsv4Attention, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        if (k := _eager()) is None:
            return super().attend(attn, q, keys, bias)
        return k.sink_attention(q, keys, bias, attn.sinks, attn.scaling)

    def compress(
        self,
        comp: Compressor,
        kv: torch.Tensor,
        gate: torch.Tensor,
        positions: torch.Tensor,
        cm: CompressMetadata,
        state: torch.Tensor,
        rows: torch.Tensor,
        sparse: bool,
    ) -> None:
        cos, sin = comp.rope.tables()
        norm = comp.kv_norm
        k = kernels.ops()  # kept under a compiler too (see the module's docstring)
        if k is None or not _fp32(kv, gate, state, rows, comp.position_bias, cos, norm.weight):
            return super().compress(comp, kv, gate, positions, cm, state, rows, sparse)
        k.compress_decode(
            kv, gate, comp.position_bias, positions, cm.state_write_mask, cm.state_write_loc,
            cm.state_read_start, cm.state_read_slots, cm.block_mask, cm.block_loc, cm.block_positions,
            cos, sin, norm.weight, norm.eps, state, rows,
        )  # fmt: skip

    def index_topk(
        self,
        indexer: Indexer,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        page_table: torch.Tensor,
        visible: torch.Tensor,
        page_size: int,
    ) -> torch.Tensor:
        if (k := _eager()) is None or not _fp32(q, weights, keys):
            return super().index_topk(indexer, q, weights, keys, page_table, visible, page_size)
        return k.index_topk(
            q, weights, keys, page_table, visible, indexer.ratio, page_size, indexer.softmax_scale, indexer.topk
        )  # fmt: skip

    def paged_attend(
        self,
        attn: Dsv4Attention,
        q: torch.Tensor,
        swa: torch.Tensor,
        swa_slots: torch.Tensor,
        comp: torch.Tensor | None,
        page_table: torch.Tensor,
        rows: torch.Tensor | None,
        visible: torch.Tensor | None,
        page_size: int,
    ) -> torch.Tensor:
        if (k := _eager()) is None or not _fp32(q, swa, attn.sinks, comp):
            return super().paged_attend(attn, q, swa, swa_slots, comp, page_table, rows, visible, page_size)
        return k.paged_attention(
            q, swa, swa_slots, comp, page_table, rows, visible, attn.ratio, page_size, attn.sinks, attn.scaling
        )  # fmt: skip


def _eager() -> Any:
    """The kernels' direct bindings where this call runs eagerly (None under a compiler, which fuses
    the torch forms, or inside `kernels.disabled()`)."""
    return None if torch.compiler.is_compiling() else kernels.bound()


def _fp32(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given (None: absent) is fp32, the kernels' one dtype."""
    return all(t is None or t.dtype is torch.float32 for t in tensors)
