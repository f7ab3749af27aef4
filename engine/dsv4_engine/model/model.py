"""DeepSeek-V4 decoder: embedding -> hc_mult streams -> layers (mHC around attention and
MoE) -> head collapse -> norm -> lm_head. Module paths equal HF's state-dict names."""

from __future__ import annotations

import torch
from torch import nn

from dsv4_engine import kernels
from dsv4_engine.config import Dsv4Config
from dsv4_engine.model.attention import Dsv4Attention
from dsv4_engine.model.batch import StepBatch
from dsv4_engine.model.hyper import HyperConnection, HyperHead
from dsv4_engine.model.moe import MoE
from dsv4_engine.model.ops import KernelChoice, Linear, Module, RMSNorm
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
        (small preset, 2048 tokens: 9 ms against 1.5 ms)."""
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(collapsed), batch)
        mid = self.attn_hc.expand(post, comb, out, streams, into=spare)
        post, comb, collapsed = self.ffn_hc(mid)
        out = self.mlp(self.post_attention_layernorm(collapsed), batch)
        return self.ffn_hc.expand(post, comb, out, mid, into=streams)


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
        return self.norm(self.hc_head(streams))


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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits."""
        return self.lm_head(hidden).float()

    def use_kernels(self, enabled: bool | None) -> bool:
        """Fix every module's kernel choice (`model.ops.KernelChoice`): the fused CPU kernels where
        they are built and the model is on CPU, never with False; None: decided per call again.
        Returns whether the modules now use them."""
        on = None if enabled is None else bool(enabled) and kernels.use_for(self.device)
        for m in self.modules():
            if isinstance(m, KernelChoice):
                m.use_kernels = on
        return kernels.use_for(self.device) if on is None else on

    def kernels_fixed(self) -> bool:
        """The modules' fixed kernel choice, or where none is fixed yet, whether kernels serve the
        model's device."""
        fixed = {m.use_kernels for m in self.modules() if isinstance(m, KernelChoice)}
        if fixed == {None}:
            return kernels.use_for(self.device)
        return fixed == {True}
