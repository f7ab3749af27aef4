"""The CPU kernel set: the fused C++ kernels (`cpu.cpp`, `attention.cpp`, `pages.cpp`, built once a
process by `kernels.build`), each op falling back to its torch form where the kernel does not serve.

Eager torch pays a Python dispatch per op (5-10 us on these machines), and an aten op called from C++
still pays its own setup (~5 us): the mHC Sinkhorn alone is ~80 ops per sub-block. So the kernels are
plain loops: fp32 loops on one thread up to `LOOP_ROWS` rows (norms, RoPE, the router, mHC expand:
other dtypes keep torch's op order, which HF's bf16 rounding follows; more rows, a prefill's, take the
multi-threaded aten forms), and kernels with a GEMM inside (projections, experts, the mHC map) that
take BLAS and the op order for other sizes and dtypes themselves. The attention over the pools reads
them in place (`attention.cpp`) instead of ~50 gathers, masks and concatenations a layer.

Eager calls go to the direct bindings (`build.module()`, ~1 us a call less than the dispatcher; the
registered ops under a dispatch mode, which then sees them). Variants:
- `CpuKernels`: extend steps;
- `CpuDecodeKernels`: the eager decode step, which also takes the per-head query norm as a kernel
  (extend keeps torch's, whose summation order its prefill logits have always had);
- `CompiledCpuKernels`: the decode step under `torch.compile`, where only the kernels that do less
  work than anything inductor generates stay, as opaque `torch.ops.dsv4` calls (projections, experts,
  the compressor, which pools only rows completing a block); the rest are inductor's to fuse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dsv4_engine.attention.decode_fill import fill_decode_buffers_kernel
from dsv4_engine.kernels import build
from dsv4_engine.kernels.base import KernelSet
from dsv4_engine.kernels.torch_forms import CompiledTorchKernels, TorchKernels
from dsv4_engine.kernels.torch_ops import index_scores

if TYPE_CHECKING:
    from dsv4_engine.attention.decode_fill import DecodeLocs
    from dsv4_engine.attention.metadata import AttentionMetadata, CompressMetadata
    from dsv4_engine.memory.req_to_token import Dsv4ReqPool

Tensor = torch.Tensor
_F32 = torch.float32
_dispatch_modes = torch._C._len_torch_dispatch_stack
# The largest decode batch (attention.decode_buffers.DEFAULT_BUCKETS): up to it the one-dispatch loops
# win (a step pays ~5-10 us per dispatched op); past it, a prefill's rows, the multi-threaded aten forms.
LOOP_ROWS = 256


def _fp32(*tensors: Tensor | None) -> bool:
    """Whether every tensor given (None: absent) is fp32, the attention kernels' one dtype."""
    return all(t is None or t.dtype is _F32 for t in tensors)


class _CompilerKeeps:
    """The ops that stay kernels under a compiler too, shared by the eager and compiled CPU sets:
    `_ops()` is the direct bindings eagerly, the registered (opaque) ops under a compiler."""

    def __init__(self) -> None:
        if not build.available():
            raise RuntimeError("the dsv4 CPU kernels are not built (DSV4_KERNELS=0, or no C++ compiler)")

    def _ops(self) -> Any:
        raise NotImplementedError

    # ---- projections: a skinny GEMM streaming the weight once below 32 rows, at::linear from there
    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return self._ops().linear(x, weight)

    def grouped_linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return self._ops().grouped_linear(x, weight)

    # ---- experts: grouped by expert without gather or scatter passes; only the picked experts'
    # weights are read, which nothing a compiler makes of the gathers does
    def routed_experts(
        self, x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, limit: float
    ) -> Tensor:
        return self._ops().moe_experts(x, gate_up, down, ids, weights, limit)

    def shared_expert(self, x: Tensor, gate_up: Tensor, down: Tensor, limit: float) -> Tensor:
        return self._ops().shared_expert(x, gate_up, down, limit)

    # ---- the compressor: pools only rows completing a block (the static torch form pools every row)
    def compress_paged(
        self,
        kv: Tensor,
        gate: Tensor,
        position_bias: Tensor,
        positions: Tensor,
        cm: CompressMetadata,
        cos: Tensor,
        sin: Tensor,
        norm_weight: Tensor,
        norm_eps: float,
        state: Tensor,
        rows: Tensor,
        sparse: bool,
    ) -> None:
        if not _fp32(kv, gate, state, rows, position_bias, cos, norm_weight):
            return super().compress_paged(  # type: ignore[misc]
                kv, gate, position_bias, positions, cm, cos, sin, norm_weight, norm_eps, state, rows, sparse
            )
        self._ops().compress_decode(
            kv=kv, gate=gate, position_bias=position_bias, positions=positions,
            write_mask=cm.state_write_mask, write_loc=cm.state_write_loc, read_start=cm.state_read_start,
            read_slots=cm.state_read_slots, block_mask=cm.block_mask, block_loc=cm.block_loc,
            block_positions=cm.block_positions, cos=cos, sin=sin, norm_weight=norm_weight, norm_eps=norm_eps,
            state=state, rows=rows,
        )  # fmt: skip


class CpuKernels(_CompilerKeeps, TorchKernels):
    """Extend steps' CPU kernels."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._bound = build.module()

    def _ops(self) -> Any:
        """The direct bindings, or the registered ops while a dispatch mode is active."""
        return torch.ops.dsv4 if _dispatch_modes() else self._bound

    def for_decode(self, compiled: bool) -> KernelSet:
        return CompiledCpuKernels() if compiled else CpuDecodeKernels()

    # ---- norms and RoPE: fp32 loops for a decode step's rows
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dtype is _F32 and x.shape[0] <= LOOP_ROWS:
            return self._ops().rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
        if x.dtype is _F32 and x.shape[0] <= LOOP_ROWS:  # the same values as the torch form
            return self._ops().rope_rotate(x, cos, sin, inverse)
        return super().rope(x, cos, sin, inverse)

    # ---- mHC: the map's Sinkhorn vectorised across rows (BLAS for many rows); expand as loops -----
    def hc_pre(
        self,
        streams: Tensor,
        fn: Tensor,
        base: Tensor,
        scale: Tensor,
        iters: int,
        hc_eps: float,
        norm_eps: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return self._ops().hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps)

    def hc_post(self, post: Tensor, comb: Tensor, out: Tensor, streams: Tensor, into: Tensor) -> Tensor:
        if streams.dtype is _F32 and streams.shape[0] <= LOOP_ROWS:
            return self._ops().hc_post(post, comb, out, streams)
        return super().hc_post(post, comb, out, streams, into)

    # ---- the router ----------------------------------------------------------------------------
    def route(
        self,
        x: Tensor,
        input_ids: Tensor,
        weight: Tensor,
        table: Tensor,
        is_hash: bool,
        top_k: int,
        scaling: float,
    ) -> tuple[Tensor, Tensor]:
        if x.dtype is _F32 and x.shape[0] <= LOOP_ROWS:
            return self._ops().route(x, input_ids, weight, table, is_hash, top_k, scaling)
        return super().route(x, input_ids, weight, table, is_hash, top_k, scaling)

    # ---- attention over the pools, read in place ------------------------------------------------
    def masked_put(self, pool: Tensor, slots: Tensor, rows: Tensor, mask: Tensor) -> None:
        self._ops().masked_put(pool, slots, rows, mask)

    def sink_attention(self, q: Tensor, keys: Tensor, bias: Tensor, sinks: Tensor, scaling: float) -> Tensor:
        return self._ops().sink_attention(q, keys, bias, sinks, scaling)

    def paged_attention(
        self,
        q: Tensor,
        swa: Tensor,
        swa_slots: Tensor,
        comp: Tensor | None,
        page_table: Tensor,
        rows: Tensor | None,
        visible: Tensor | None,
        ratio: int,
        page_size: int,
        sinks: Tensor,
        scaling: float,
    ) -> Tensor:
        if not _fp32(q, swa, sinks, comp):
            return super().paged_attention(
                q, swa, swa_slots, comp, page_table, rows, visible, ratio, page_size, sinks, scaling
            )
        return self._ops().paged_attention(
            q=q, swa=swa, swa_slots=swa_slots, comp=comp, page_table=page_table, comp_rows=rows,
            visible=visible, ratio=ratio, page_size=page_size, sinks=sinks, scaling=scaling,
        )  # fmt: skip

    def block_attention(self, q: Tensor, keys: Tensor, bias: Tensor, sinks: Tensor, scaling: float) -> Tensor:
        """Each query over only the keys its bias leaves (a C4 layer's indexer picks ~k of its rows)."""
        if not _fp32(q, keys, bias, sinks):
            return super().block_attention(q, keys, bias, sinks, scaling)
        return self._ops().block_attention(
            q.contiguous(), keys.contiguous(), bias.contiguous(), sinks, scaling
        )

    def index_bias(
        self, q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, scale: float, k: int
    ) -> Tensor:
        """The torch form's scores (BLAS, its rounding), then each query row's top-k in one pass
        instead of a stable sort of every row."""
        if len(keys) <= k:
            return super().index_bias(q, weights, keys, visible, scale, k)
        return self._ops().topk_bias(index_scores(q, weights, keys, scale), visible, k)

    def index_topk(
        self,
        q: Tensor,
        weights: Tensor,
        keys: Tensor,
        page_table: Tensor,
        visible: Tensor,
        ratio: int,
        page_size: int,
        scale: float,
        k: int,
    ) -> Tensor:
        if not _fp32(q, weights, keys):
            return super().index_topk(q, weights, keys, page_table, visible, ratio, page_size, scale, k)
        return self._ops().index_topk(
            q=q, weights=weights, keys=keys, page_table=page_table, visible=visible, ratio=ratio,
            page_size=page_size, softmax_scale=scale, k=k,
        )  # fmt: skip

    def fill_decode(
        self,
        buf: AttentionMetadata,
        req_pool: Dsv4ReqPool,
        page_size: int,
        req: Tensor,
        pos: Tensor,
        valid: Tensor,
        locs: DecodeLocs,
    ) -> None:
        fill_decode_buffers_kernel(buf, req_pool, page_size, req, pos, valid, locs)

    # ---- PD staging: one call per state type instead of an index_select per layer buffer ----------
    def gather_pages(self, buffers: list[Tensor], pages: Tensor, staged: Tensor) -> None:
        if staged.device.type != "cpu" or not all(b.is_contiguous() for b in buffers):
            return super().gather_pages(buffers, pages, staged)
        torch.ops.dsv4.gather_pages(buffers, pages, staged)

    def scatter_pages(self, buffers: list[Tensor], pages: Tensor, staged: Tensor) -> None:
        if staged.device.type != "cpu" or not all(b.is_contiguous() for b in buffers):
            return super().scatter_pages(buffers, pages, staged)
        torch.ops.dsv4.scatter_pages(buffers, pages, staged)


class CpuDecodeKernels(CpuKernels):
    """The eager decode step's: `CpuKernels` with the per-head query norm as a kernel too."""

    def head_rms_norm(self, x: Tensor, eps: float) -> Tensor:
        if x.dtype is _F32 and x.shape[0] <= LOOP_ROWS:
            return self._ops().rms_norm(x, None, eps)
        return super().head_rms_norm(x, eps)


class CompiledCpuKernels(_CompilerKeeps, CompiledTorchKernels):
    """The decode step's under `torch.compile`: the opaque kernels, inductor's torch forms."""

    name = "cpu"

    def _ops(self) -> Any:
        return torch.ops.dsv4

    def for_decode(self, compiled: bool) -> KernelSet:
        return CompiledCpuKernels() if compiled else CpuDecodeKernels()
