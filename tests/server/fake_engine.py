"""A stand-in honouring the LLMEngine contract, for what the real engine cannot do on demand.

Used to inject failures (a step that raises), to hold requests in the queue (a step gate), and to
count pages. Token i of a request is `(prompt[-1] + 1 + i) % vocab`, so outputs are predictable.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


@dataclass
class _Req:
    request_id: str
    prompt: list[int]
    params: Any
    out: list[int] = field(default_factory=list)


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class FakeEngine:
    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int = 256,
        max_num_seqs: int = 4,
        pages: int = 64,
        step_delay: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(
            vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, model_type="deepseek_v4"
        )
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.total_pages = pages
        self.free_pages = pages
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.fail_next_step = False
        self.gate = threading.Event()  # cleared: step() produces nothing (requests stay queued)
        self.gate.set()
        self.steps = 0
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generated = 0
        self.step_delay = step_delay
        self.aborted: list[str] = []
        self.stall = threading.Event()  # set: the next step blocks until `resume` is set
        self.resume = threading.Event()
        self.stalled = threading.Event()  # set while a step is blocked

    def add_request(
        self, prompt_token_ids: list[int], sampling_params: Any, request_id: str | None = None
    ) -> str:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        rid = request_id or str(id(prompt_token_ids))
        self.waiting.append(_Req(rid, list(prompt_token_ids), sampling_params))
        return rid

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        for queue in (self.waiting, self.running):
            for r in list(queue):
                if r.request_id == request_id:
                    queue.remove(r)
                    if queue is self.running:
                        self.free_pages += 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[StepOutput]:
        if self.fail_next_step:
            raise RuntimeError("injected step failure")
        if not self.gate.is_set():
            self.gate.wait(0.01)
            return []
        self.steps += 1
        if self.stall.is_set():
            self.stalled.set()
            self.resume.wait(60)
            self.stalled.clear()
        if self.step_delay:
            time.sleep(self.step_delay)
        while self.waiting and len(self.running) < self.max_num_seqs and self.free_pages > 0:
            r = self.waiting.pop(0)
            self.free_pages -= 1
            self.prompt_tokens += len(r.prompt)
            self.running.append(r)
        outputs = []
        for r in list(self.running):
            tok = (r.prompt[-1] + 1 + len(r.out)) % len(self.tokenizer)
            r.out.append(tok)
            self.generated += 1
            p = r.params
            stop = tok in set(p.stop_token_ids) or (not p.ignore_eos and tok == self.tokenizer.eos_token_id)
            length = len(r.out) >= p.max_tokens
            done = stop or length
            if done:
                self.running.remove(r)
                self.free_pages += 1
            outputs.append(
                StepOutput(r.request_id, [tok], done, "stop" if stop else "length" if done else None)
            )
        return outputs

    def metrics(self) -> dict[str, float]:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.preemptions,
            "prompt_tokens_total": self.prompt_tokens,
            "generation_tokens_total": self.generated,
            "pool_usage/fake": 1 - self.free_pages / self.total_pages,
        }
