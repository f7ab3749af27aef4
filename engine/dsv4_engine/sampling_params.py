"""Per-request sampling settings (vLLM's names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The most top logprobs one position may ask for (vLLM's default --max-logprobs, OpenAI chat's limit).
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    max_tokens: int = 16
    ignore_eos: bool = False  # keep generating past EOS (EOS is still a candidate token)
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Penalties, as vLLM applies them: presence/frequency (OpenAI's definition) over the output tokens,
    # repetition (HF's: positive logits divided, negative multiplied) over prompt and output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the most likely one's
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # Logprobs of the raw model distribution (before temperature, penalties, bias, filters), as vLLM's
    # default: None: none; k >= 0: the sampled (or prompt) token's logprob and the k most likely.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Constrained decoding: an llguidance grammar (Lark text; dsv4_engine.grammar) every output token
    # must follow; EOS is allowed only where the grammar may end, and forced once it must.
    grammar: str | None = None
    # vLLM's bad_words, as token sequences: a sequence's last token is masked wherever the output
    # ends with the rest of it (a one-token sequence: always).
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's allowed_token_ids: every other token is masked.
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logit_bias is not None:
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logit_bias):
                raise ValueError("logit_bias keys must be non-negative token ids")
            if any(not math.isfinite(b) for b in self.logit_bias.values()):
                raise ValueError("logit_bias values must be finite")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.bad_words_token_ids is not None:
            if any(
                not seq or any(not isinstance(t, int) or t < 0 for t in seq)
                for seq in self.bad_words_token_ids
            ):
                raise ValueError("bad_words_token_ids must be non-empty lists of non-negative token ids")
            self.bad_words_token_ids = [list(seq) for seq in self.bad_words_token_ids]
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or any(
                not isinstance(t, int) or t < 0 for t in self.allowed_token_ids
            ):
                raise ValueError("allowed_token_ids must be a non-empty list of non-negative token ids")
            self.allowed_token_ids = list(self.allowed_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (they need the request's token history)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
