"""DeepSeek-V4 decoder: embedding -> hc_mult streams -> layers (mHC around attention and
MoE) -> head collapse -> norm -> lm_head. Module paths equal HF's state-dict names."""

from __future__ import annotations

import torch
from torch import nn

from dsv4_engine.config import Dsv4Config
from dsv4_engine.kernels import KernelSet, choose_kernels
from dsv4_engine.model.attention import Dsv4Attention
from dsv4_engine.model.batch import StepBatch
from dsv4_engine.model.hyper import HyperConnection, HyperHead
from dsv4_engine.model.moe import MoE
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
    "inv_freq",
)


class DecoderLayer(Module):
    def __init__(
        self, config: Dsv4Config, layer: int, rope: RopeRegistry, parallel: Parallel = SINGLE
    ) -> None:
        super().__init__()
        self.self_attn = Dsv4Attention(
            config, layer, rope.get(config.rope_main), rope.get(config.rope_compress), parallel
        )
        self.mlp = MoE(config, layer, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, batch: StepBatch, spare: torch.Tensor) -> torch.Tensor:
        """New streams; `spare` (streams' shape) takes the streams between attention and MoE and
        `streams` the result, overwritten once dead (where `HyperConnection.expand` writes in place).
        Fresh buffers this size can cost more in page faults than the arithmetic that fills them
        (small preset, 2048 tokens: 9 ms against 1.5 ms). `HyperConnection` maps the streams
        (`KernelSet.hc_pre`), the set's `hc_post` spreads a sub-block's output back over them."""
        k = batch.kernels
        post, comb, collapsed = self.attn_hc(streams, k)
        out = self.self_attn(self.input_layernorm(collapsed, k), batch)
        mid = k.hc_post(post, comb, out, streams, spare)
        post, comb, collapsed = self.ffn_hc(mid, k)
        out = self.mlp(self.post_attention_layernorm(collapsed, k), batch)
        return k.hc_post(post, comb, out, mid, streams)


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
        batch.check_positions(self.rope.max_positions)
        for table in self.rope.tables.values():  # one lookup per table per forward, shared by layers
            batch.memo[id(table)] = table.lookup(batch.positions)
        x = self.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        spare = torch.empty_like(streams)
        for layer in self.layers:
            streams = layer(streams, batch, spare)
        batch.advance()
        return self.norm(self.hc_head(streams), batch.kernels)


class Dsv4ForCausalLM(Module):
    """`parallel`: this rank's place among tp_size ranks (parallel/groups.py); its modules then hold
    that rank's shard, and the embedding, norms and lm_head are replicated."""

    def __init__(
        self, config: Dsv4Config, max_positions: int | None = None, parallel: Parallel = SINGLE
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.model = Dsv4Model(config, max_positions or config.max_position_embeddings, parallel)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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
