"""DeepSeek-V4 decoder: embedding -> hc_mult streams -> layers (mHC around attention and
MoE) -> head collapse -> norm -> lm_head. Module paths equal HF's state-dict names."""

from __future__ import annotations

import torch
from torch import nn

from dsv4_engine.config import Dsv4Config
from dsv4_engine.kernels import KernelSet, choose_kernels
from dsv4_engine.model.batch import StepBatch
from dsv4_engine.model.hyper import HyperHead
from dsv4_engine.model.layer import DecoderLayer
from dsv4_engine.model.mtp import MtpLayer
from dsv4_engine.model.ops import Linear, Module, RMSNorm
from dsv4_engine.parallel.groups import SINGLE, Parallel
from dsv4_engine.rope import RopeRegistry

# Parameters HF keeps in fp32 whatever the model dtype (`_keep_in_fp32_modules_strict`),
# matched by path component; plus our RoPE frequencies.
FP32_NAMES = (
    "attn_hc",
    "ffn_hc",
    "hc_head",
    "sinks",
    "position_bias",
    "e_score_correction_bias",
    "q_a_norm",
    "kv_norm",
    "input_layernorm",
    "post_attention_layernorm",
    "norm",
    "enorm",
    "hnorm",
    "inv_freq",
)


class Dsv4Model(Module):
    def __init__(self, config: Dsv4Config, max_positions: int, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rope = RopeRegistry(config.qk_rope_head_dim, max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rope, parallel) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)
        self.rope.build()

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Final hidden states `[T, hidden]` of any step: an extend `ForwardBatch` or the batched
        decode step's `DecodeBatch` (model/batch.py); writes the step's state, advances the caches."""
        return self.head(self.streams(batch), batch)

    def prepare(self, batch: StepBatch) -> None:
        """Per-forward lookups every layer shares: one per RoPE table."""
        batch.check_positions(self.rope.max_positions)
        for table in self.rope.tables.values():
            batch.memo[id(table)] = table.lookup(batch.positions)

    def streams(self, batch: StepBatch) -> torch.Tensor:
        """The last layer's streams `[T, hc, hidden]`, before the head's collapse (what the MTP
        layer reads)."""
        self.prepare(batch)
        x = self.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        spare = torch.empty_like(streams)
        for layer in self.layers:
            streams = layer(streams, batch, spare)
        batch.advance()
        return streams

    def head(self, streams: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        return self.norm(self.hc_head(streams), batch.kernels)


class Dsv4ForCausalLM(Module):
    """`parallel`: this rank's place among tp_size ranks (parallel/groups.py); its modules then hold
    that rank's shard, and the embedding, norms and lm_head are replicated."""

    def __init__(
        self,
        config: Dsv4Config,
        max_positions: int | None = None,
        parallel: Parallel = SINGLE,
        *,
        mtp: bool = False,
    ) -> None:
        """mtp: also build the checkpoint's MTP layer (speculative decoding's draft model)."""
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.model = Dsv4Model(config, max_positions or config.max_position_embeddings, parallel)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp: nn.ModuleList | None = None
        if mtp:
            if config.num_nextn_predict_layers < 1:
                raise ValueError(
                    "speculative decoding needs the checkpoint's MTP layer, and its config has "
                    "num_nextn_predict_layers = 0"
                )
            self.mtp = nn.ModuleList([MtpLayer(config, self.model.rope, parallel)])
            self.model.rope.build()  # the MTP layer's tables join the registry

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def cast(self, dtype: torch.dtype) -> Dsv4ForCausalLM:
        """Cast to `dtype`, keeping HF's fp32 modules (norms, mHC, sinks, biases) in fp32."""
        self.to(dtype)
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if tensor.is_floating_point() and any(part in FP32_NAMES for part in name.split(".")):
                tensor.data = tensor.data.float()
        return self

    def forward(self, batch: StepBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor, kernels: KernelSet | None = None) -> torch.Tensor:
        """fp32 logits; kernels: the step's set (default: what an engine on hidden's device runs)."""
        return self.lm_head(hidden, kernels or choose_kernels(hidden.device)).float()
