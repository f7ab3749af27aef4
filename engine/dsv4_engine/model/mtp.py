"""DeepSeek-V4's multi-token-prediction layer (DeepSeek's `MTPBlock`), the draft model of
speculative decoding.

At position i it reads the target's final streams x_i (before the head's collapse) and the embedding
of the next token t_{i+1}, and predicts t_{i+2}:

    y = e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(x_i))     (the embedding term on every stream)
    y = the decoder layer at id num_hidden_layers over y       (a sliding-window layer, plain MoE)
    logits = lm_head(norm(hc_head(y)))                         (its own hc_head and norm, shared head)

Drafting k tokens applies it again with x = its own output streams y and the token it predicted.
Names follow HF's layer names under `mtp.0.` (ckpt_names.MTP_NAMES maps the released ones).
"""

from __future__ import annotations

import dataclasses

import torch

from dsv4_engine.config import MOE, SLIDING, Dsv4Config
from dsv4_engine.kernels import KernelSet
from dsv4_engine.model.batch import StepBatch
from dsv4_engine.model.hyper import HyperHead
from dsv4_engine.model.layer import DecoderLayer
from dsv4_engine.model.ops import Linear, RMSNorm
from dsv4_engine.parallel.groups import SINGLE, Parallel
from dsv4_engine.rope import RopeRegistry


def mtp_config(config: Dsv4Config) -> Dsv4Config:
    """The config with the MTP layer as one more layer: a sliding-window attention layer (its entry of
    the released `compress_ratios` is 0) with a plain (not hashed) MoE."""
    return dataclasses.replace(
        config,
        num_hidden_layers=config.num_hidden_layers + 1,
        layer_types=[*config.layer_types, SLIDING],
        mlp_layer_types=[*config.mlp_layer_types, MOE],
    )


class MtpLayer(DecoderLayer):
    def __init__(self, config: Dsv4Config, rope: RopeRegistry, parallel: Parallel = SINGLE) -> None:
        self.layer_id = config.num_hidden_layers
        super().__init__(mtp_config(config), self.layer_id, rope, parallel)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.e_proj = Linear(hidden, hidden)
        self.h_proj = Linear(hidden, hidden)
        self.norm = RMSNorm(hidden, eps)
        self.hc_head = HyperHead(config)

    def draft(self, streams: torch.Tensor, embeds: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Output streams `[T, hc, hidden]` from the previous streams `[T, hc, hidden]` (the target's,
        or this layer's own when chaining) and the next tokens' embeddings `[T, hidden]`; writes the
        tokens' window rows of this layer through the batch."""
        k = batch.kernels
        t, n, h = streams.shape
        e = self.e_proj(self.enorm(embeds, k), k)
        x = self.h_proj(self.hnorm(streams.reshape(t * n, h), k), k).view(t, n, h)
        x = (x + e.unsqueeze(1)).contiguous()
        return super().forward(x, batch, torch.empty_like(x))

    def hidden(self, streams: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        """What the shared lm_head reads: its own collapse and norm."""
        return self.norm(self.hc_head(streams), kernels)
