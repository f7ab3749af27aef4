"""`LLMEngine`: requests in, tokens out, one `step()` at a time.

Simple scheduling for now: a step prefills every waiting request that fits (one forward for
all of them), otherwise it decodes every running request together (one forward, one token
each). Each request owns a dense `SeqCache`. The paged scheduler replaces this class's
internals and keeps its interface.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4_engine.config import Dsv4Config
from dsv4_engine.device import resolve_dtype, select_device
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch, SeqCache
from dsv4_engine.sampler import sample
from dsv4_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 16384  # caps the RoPE tables; the real model allows 1M positions


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    cache: SeqCache | None = None
    generator: torch.Generator | None = None
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def load_model(
    model_path: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int
) -> Dsv4ForCausalLM:
    from dsv4_engine.loader import load_checkpoint

    config = Dsv4Config.from_pretrained(model_path)
    model = Dsv4ForCausalLM(config, max_positions=max_positions).cast(dtype)
    load_checkpoint(model, model_path, dtype=None)
    return model.to(device).eval()


class LLMEngine:
    def __init__(
        self,
        model_path: str | Path,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        tokenizer: object | None = None,
        **kwargs: object,
    ) -> None:
        if kwargs:
            log.info("LLMEngine ignores options it does not use yet: %s", sorted(kwargs))
        self.device = select_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.config = Dsv4Config.from_pretrained(model_path)
        self.max_model_len = min(max_model_len or DEFAULT_MAX_MODEL_LEN, self.config.max_position_embeddings)
        self.max_num_seqs = max_num_seqs
        self.model = load_model(model_path, self.dtype, self.device, self.max_model_len)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.tokenizer = tokenizer
        self.eos_token_ids = set(self.config.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "num_preemptions": 0}

    def add_request(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str | None = None
    ) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit max_model_len={self.max_model_len}"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
        req = Request(request_id, list(prompt_token_ids), sampling_params)
        if sampling_params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(sampling_params.seed)
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def metrics(self) -> dict[str, float]:
        return {"num_running": float(len(self.running)), "num_waiting": float(len(self.waiting))} | {
            k: float(v) for k, v in self.counters.items()
        }

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        if self.waiting and len(self.running) < self.max_num_seqs:
            batch_reqs = []
            while self.waiting and len(self.running) + len(batch_reqs) < self.max_num_seqs:
                req = self.waiting.popleft()
                req.cache = self.model.new_cache()
                batch_reqs.append(req)
            chunks = [(r.cache, r.prompt_token_ids) for r in batch_reqs]
            self.counters["prompt_tokens_total"] += sum(len(r.prompt_token_ids) for r in batch_reqs)
            self.running.extend(batch_reqs)
        elif self.running:
            batch_reqs = list(self.running)
            chunks = [(r.cache, r.output_token_ids[-1:]) for r in batch_reqs]
        else:
            return []
        batch = ForwardBatch.build(chunks, device=self.device)
        hidden = self.model(batch)
        last_rows = torch.tensor([s.offset + s.length - 1 for s in batch.seqs], device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, last_rows))
        tokens = sample(logits, [r.params for r in batch_reqs], [r.generator for r in batch_reqs])
        return [self._append(req, token) for req, token in zip(batch_reqs, tokens, strict=True)]

    def _append(self, req: Request, token: int) -> StepOutput:
        req.output_token_ids.append(token)
        self.counters["generation_tokens_total"] += 1
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            req.finish_reason = "stop"
        elif len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self.running.remove(req)
            self.requests.pop(req.request_id, None)
            self._release(req)
        return StepOutput(req.request_id, [token], req.finish_reason is not None, req.finish_reason)

    def _release(self, req: Request) -> None:
        if req.cache is not None:
            req.cache.free()
            req.cache = None
