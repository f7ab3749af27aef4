"""The kernel-set interface: every op the model's forward, the decode step and PD staging run.

An engine chooses one set once (`kernels.choose_kernels`: device and options) and every step's batch
carries it; each module calls the op it needs on the set it is handed. Ops take plain tensors and
numbers (a module passes its own parameters), never a module, so a set has no view of the model and
a device's kernels (torch_npu's `npu_rms_norm`, `npu_interleave_rope`, `npu_moe_gating_top_k`,
`npu_grouped_matmul`, `npu_scatter_nd_update_`, sparse attention with block tables) map one op each.

A set also names the variant a batched decode step runs (`for_decode`): static shapes and no host
reads, so the step can be compiled or captured as a device graph. Implementations:
`torch_forms.TorchKernels` (the reference torch code every other set is tested against, and the
fallback inside them), `cpu.CpuKernels` (the fused C++ kernels); an NPU set subclasses
`TorchKernels` the same way.

Shapes: T tokens (rows) first; H heads; D head dim; R RoPE dims (the trailing R of D); B decode rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from dsv4_engine.attention.decode_fill import DecodeLocs
    from dsv4_engine.attention.metadata import AttentionMetadata, CompressMetadata
    from dsv4_engine.memory.req_to_token import Dsv4ReqPool

Tensor = torch.Tensor


class KernelSet(ABC):
    """One implementation of every op. `name` is the set's family ("torch", "cpu"), shared by its
    decode variants."""

    name: ClassVar[str]
    # Whether `quant_linear` and `quant_routed_experts` are the device's own W8A8 matmuls, so a loader
    # should keep W8A8 weights int8 for this set (`loader.load_checkpoint(keep_int8=...)`); elsewhere
    # they are dequantised at load (the torch forms of both ops exist for tests only).
    native_w8a8: ClassVar[bool] = False

    @abstractmethod
    def for_decode(self, compiled: bool) -> KernelSet:
        """The variant a batched decode step runs (one token per row, the bucket's static shapes);
        compiled: the step runs under `torch.compile`, which fuses torch forms itself."""

    # ---- dense layers --------------------------------------------------------------------------
    @abstractmethod
    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """`x @ weight.T` for x `[..., in]`, weight `[out, in]` (no bias)."""

    @abstractmethod
    def quant_linear(self, x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        """W8A8 `x @ (weight * scale[:, None]).T` in x's dtype, for int8 weight `[out, in]` and its
        float32 per-row scale `[out]`: x quantised to int8 per token (scale rowmax|x| / 127),
        int8 products summed in int32, the sums rescaled by both scales."""

    @abstractmethod
    def grouped_linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """Block-diagonal projection `[T, G, in] -> [T, G*R]`: group g uses rows [g*R, (g+1)*R) of
        weight `[G*R, in]`."""

    @abstractmethod
    def quant_grouped_linear(self, x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        """`grouped_linear` in W8A8, for int8 weight `[G*R, in]` and its float32 per-row scale
        `[G*R]`: each token's group row quantised to int8 on its own (as `quant_linear` quantises a
        token), int8 products summed in int32, the sums rescaled by both scales."""

    @abstractmethod
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMS norm over the last dim in fp32, times the (fp32) weight, in x's dtype."""

    @abstractmethod
    def head_rms_norm(self, x: Tensor, eps: float) -> Tensor:
        """RMS norm without a weight (the scale in fp32, applied in x's dtype) of a fresh tensor: it
        may be computed in x's own storage."""

    @abstractmethod
    def rope(self, x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
        """Interleaved RoPE of the trailing R channels of a fresh x `[T, ..., D]`, one cos/sin row
        `[T, R]` per token (looked up from the model's tables); inverse undoes it. May rotate x in
        place."""

    # ---- mHC -----------------------------------------------------------------------------------
    @abstractmethod
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
        """The mHC map of streams `[T, N, D]`: (post `[T, N]`, comb `[T, N, N]` after Sinkhorn-Knopp,
        the collapsed sub-block input `[T, D]`); fp32 but the last."""

    @abstractmethod
    def hc_post(self, post: Tensor, comb: Tensor, out: Tensor, streams: Tensor, into: Tensor) -> Tensor:
        """New streams `post_k * out + sum_j comb[j, k] * streams_j`; `into` (streams' shape, not
        streams) may take the result."""

    # ---- MoE -----------------------------------------------------------------------------------
    @abstractmethod
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
        """(weights `[T, k]`, expert ids `[T, k]`): scores `sqrt(softplus(x @ weight.T))`, ids the
        top-k of scores + table (the correction bias) or `table[input_ids]` (is_hash), weights the
        picked scores normalised, times scaling. The ids' integer dtype is the set's (int32 on NPU,
        what its expert ops take); the MoE hands them on to the same set's `routed_experts`."""

    @abstractmethod
    def routed_experts(
        self, x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor, limit: float
    ) -> Tensor:
        """Sum over each row's (expert, weight) pairs of `down_e @ swiglu(gate_up_e @ x)` `[T, D]`;
        gate_up `[E, 2I, D]` (gate rows first), down `[E, D, I]`, ids `[T, k]` local expert ids, -1
        for a pair another rank holds (skipped); swiglu clamps gate to <= limit, up to [-limit, limit]."""

    @abstractmethod
    def quant_routed_experts(
        self,
        x: Tensor,
        gate_up: Tensor,
        gate_up_scale: Tensor,
        down: Tensor,
        down_scale: Tensor,
        ids: Tensor,
        weights: Tensor,
        limit: float,
    ) -> Tensor:
        """`routed_experts` with W8A8 experts: int8 gate_up `[E, 2I, D]` and down `[E, D, I]`, their
        float32 per-expert, per-row scales `[E, 2I]` and `[E, D]`. Each matmul's input is quantised to
        int8 per row (x, then the SwiGLU output), summed in int32, rescaled by both scales (the weight's
        as `quant.grouped_matmul_scale` rounds it for x's dtype) into x's dtype."""

    @abstractmethod
    def shared_expert(self, x: Tensor, gate_up: Tensor, down: Tensor, limit: float) -> Tensor:
        """`down @ swiglu(gate_up @ x)` with gate_up `[2I, D]` (gate rows first), down `[D, I]`."""

    def routed_and_shared(self, routed: Callable[[], Tensor], shared: Callable[[], Tensor]) -> Tensor:
        """A MoE layer's output `[T, D]`: `routed()` (the router and routed experts, a fresh tensor)
        plus `shared()` (the shared expert), added in place in that order. Where and when each runs is
        the set's choice (the NPU decode set overlaps them on two streams); here one after the other,
        on the current stream."""
        return routed().add_(shared())

    # ---- attention of an extend step (one request's chunk at a time, dense keys) -------------------
    @abstractmethod
    def block_attention(self, q: Tensor, keys: Tensor, bias: Tensor, sinks: Tensor, scaling: float) -> Tensor:
        """Softmax over [keys | sink] per head for blocks of queries: q `[nb, b, H, D]`, keys
        `[nb, K, D]` per block, bias `[nb, b, K]` per query (additive, -inf masks); `[nb*b, H, D]`."""

    @abstractmethod
    def compress_blocks(
        self, kv: Tensor, score: Tensor, norm_weight: Tensor, norm_eps: float, cos: Tensor, sin: Tensor
    ) -> Tensor:
        """Compressed rows `[n, D]` of n complete blocks from their pooling windows kv, score
        `[n, w, D]`: per-channel softmax of score over the window weighting kv, RMS norm, RoPE at the
        block's first position (cos/sin rows `[n, R]`)."""

    @abstractmethod
    def index_bias(
        self, q: Tensor, weights: Tensor, keys: Tensor, visible: Tensor, scale: float, k: int
    ) -> Tensor:
        """The lightning indexer's picks for one request's queries as an additive bias `[n, N]` over
        its compressed rows keys `[N, Di]`: 0 on the top-k of `sum_h weights_h * relu(q_h . key_j) *
        scale` among rows j < visible `[n]` (ties to the lower row), -inf elsewhere."""

    # ---- attention over the paged pools (the decode step) ----------------------------------------
    @abstractmethod
    def masked_put(self, pool: Tensor, slots: Tensor, rows: Tensor, mask: Tensor) -> None:
        """`pool[slots] = rows` where mask, else the sentinel (0) into slot 0."""

    @abstractmethod
    def sink_attention(self, q: Tensor, keys: Tensor, bias: Tensor, sinks: Tensor, scaling: float) -> Tensor:
        """Softmax over [keys | sink] per head: q `[B, H, D]`, keys `[B, K, D]`, bias `[B, K]`
        (additive, -inf masks); the sink joins the denominator only."""

    @abstractmethod
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
        """`sink_attention` of q `[B, H, D]` over keys read from the pools: the window `swa[swa_slots]`
        (-1 masked) and, with a compressed pool, rows `rows [B, k]` (CSA's picks; -1 or past visible:
        none) or every row (HCA) through the page table, rows at or past `visible` masked."""

    @abstractmethod
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
        """Advance a compressor by one token per row (kv, gate `[B, coff*D]`: its projections): write
        its state row, and where it completes a block, pool the block (per-channel softmax of gate +
        position_bias), RMS-norm it, rotate it at the block's first position (cos/sin: the whole
        tables) and write the compressed row. sparse: pool only rows completing a block (host reads:
        eager steps only)."""

    @abstractmethod
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
        """The lightning indexer's picks `[B, k]`: top-k of `sum_h weights_h * relu(q_h . key_j) *
        scale` over the indexer rows j < visible (through the page table), ties to the lower row;
        picks at or past visible (fewer visible rows than k) are not rows."""

    @abstractmethod
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
        """Refresh a bucket's static decode metadata in place (`attention.decode_fill`)."""

    # ---- PD staging ----------------------------------------------------------------------------
    @abstractmethod
    def gather_pages(self, buffers: list[Tensor], pages: Tensor, staged: Tensor) -> None:
        """Pack `pages` of every buffer into `staged` (uint8, buffer-major, pages in list order)."""

    @abstractmethod
    def scatter_pages(self, buffers: list[Tensor], pages: Tensor, staged: Tensor) -> None:
        """Unpack `staged` (gather_pages' layout) into `pages` of every buffer."""
