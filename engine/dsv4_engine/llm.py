"""Offline API: `LLM(model_path).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dsv4_engine.engine import LLMEngine
from dsv4_engine.sampler import TokenLogprobs
from dsv4_engine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"
    # When SamplingParams.logprobs / prompt_logprobs ask: one entry per output token / prompt token
    # (the first prompt token's is None).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens resumed from the prefix cache (vLLM's name)


class LLM:
    def __init__(
        self,
        model_path: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        **options: object,
    ) -> None:
        """`options`: `LLMEngine`'s keyword arguments (`EngineOptions`' fields, `tokenizer`)."""
        self.engine = LLMEngine(model_path, dtype=dtype, device=device, **options)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the other ranks when tp_size > 1 (they also stop when this process exits)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order; runs the engine until all are finished."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        prompt_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompt_ids, params, strict=True)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        reasons: dict[str, str | None] = dict.fromkeys(ids)
        logprobs: dict[str, list[TokenLogprobs] | None] = {
            i: [] if sp.logprobs is not None else None for i, sp in zip(ids, params, strict=True)
        }
        prompt_logprobs: dict[str, list[TokenLogprobs | None] | None] = dict.fromkeys(ids)
        cached = dict.fromkeys(ids, 0)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.logprobs is not None:
                    logprobs[out.request_id].extend(out.logprobs)  # type: ignore[union-attr]
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                cached[out.request_id] = out.cached_tokens
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        return [
            RequestOutput(
                request_id=i,
                prompt_token_ids=p,
                token_ids=tokens[i],
                text=self.tokenizer.decode(tokens[i], skip_special_tokens=True),
                finish_reason=reasons[i],
                logprobs=logprobs[i],
                prompt_logprobs=prompt_logprobs[i],
                num_cached_tokens=cached[i],
            )
            for i, p in zip(ids, prompt_ids, strict=True)
        ]
