"""What one forward pass reads of its batch, whatever the mode.

`Dsv4Model.forward` is one function for every step, and every module's `forward` runs in each: the
attention block, the compressors and the indexer compute everything from their own parameters, and
ask the batch only where state lives. The batch answers with the mode's state access, taking those
parameters as arguments (it never reads a module), and carries the step's kernel set:
- `model.extend.ForwardBatch` (extend: prefill chunks, any prefix; also the reference decode): new
  tokens of several requests, flattened, each request's state behind its `SeqCache`, one request at a
  time;
- `attention.paged_decode.DecodeBatch` (the batched decode step): one token per row, every row from
  the paged pools by static metadata, so the step can be compiled or captured.
A parameter a module adds reaches both through the same call, or neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from dsv4_engine.kernels import KernelSet
    from dsv4_engine.model.packed import Packed


class StepBatch(Protocol):
    input_ids: torch.Tensor
    memo: dict  # per-forward values every layer shares (RoPE lookups, masks), filled by the model
    kernels: KernelSet  # the ops every module runs in this step

    @property
    def positions(self) -> torch.Tensor: ...

    def check_positions(self, max_positions: int) -> None: ...

    def attention_pack(self, layer: int) -> Packed | None:
        """The attention block's input projections as one GEMM (`model.packed`), or None: one each."""
        ...

    def shared_pack(self, layer: int) -> Packed | None:
        """The shared expert's gate and up projections as one GEMM, or None: one each."""
        ...

    def compress(
        self,
        layer: int,
        name: str,
        kv: torch.Tensor,
        gate: torch.Tensor,
        position_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        norm_eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> Any:
        """Fold the step's tokens (`kv`, `gate`: a compressor's projections `[T, coff*D]`) into that
        compressor's state (`name`: "compressor" or "indexer") and write the rows of the blocks they
        complete: per-channel softmax of `gate + position_bias[p % ratio]` over the block's window,
        RMS norm, RoPE at the block's first position (cos/sin: the whole tables). Returns the mode's
        handle on the compressed rows, for `index_topk` and `attend`."""
        ...

    def index_topk(
        self, layer: int, q: torch.Tensor, weights: torch.Tensor, keys: Any, scale: float, k: int
    ) -> Any:
        """The indexer's picks among the compressed rows each token may see (`keys`: `compress`'s
        handle on the indexer's rows), top-k of `sum_h weights_h * relu(q_h . key) * scale`."""
        ...

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        rows: Any,
        picks: Any,
        sinks: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """Write the tokens' K=V rows `kv [T, D]`, then softmax per head of `q [T, H, D]` over the
        sliding window, the compressed rows (`rows`: `compress`'s handle; CSA: only `picks`, HCA: all
        visible) and the sink: `[T, H, D]`."""
        ...

    def advance(self) -> None:
        """After the forward: the state holds the step's tokens."""
        ...
