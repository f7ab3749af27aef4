"""Running the demo recipe (demo.py declares it): its documents in shuffled windows, the training
loop with its held-out evaluations, and the checkpoint written with demo.json and SHA256SUMS.
`dsv4 make-tiny --preset demo OUT` runs `train`, then the second stage (mtp_train.py: the MTP layer on
the frozen main model); `--mtp-only` runs only the second, on OUT."""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4_engine.demo import (
    BATCH,
    EVAL_EVERY,
    LR,
    MIN_LR_FRACTION,
    MTP_STEPS,
    SEED,
    SEQ_LEN,
    STEPS,
    THREADS,
    VOCAB_SIZE,
    WARMUP_STEPS,
    WEIGHT_DECAY,
    Corpus,
    config,
    corpus_digest,
    heldout_windows,
    hf_model,
    load_corpus,
    mean_nll,
    write_checksums,
)

if TYPE_CHECKING:
    import torch


def documents(corpus: Corpus, tok: object) -> list[list[int]]:
    """Token ids of every training document: plain chunks (BOS text EOS) and chat turns."""
    eos = tok.eos_token_id  # type: ignore[attr-defined]
    docs = [tok(chunk)["input_ids"] + [eos] for chunk in corpus.train]  # type: ignore[operator]
    for q, a in corpus.chat:
        turn = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        docs.append(list(tok.apply_chat_template(turn, tokenize=True, return_dict=False)))  # type: ignore[attr-defined]
    return docs


def batches(docs: list[list[int]], seq_len: int, batch: int, rng: random.Random) -> Iterator[torch.Tensor]:
    """[batch, seq_len + 1] windows, forever: each epoch shuffles the documents, joins them, cuts windows
    from a random offset and shuffles the windows."""
    import torch

    while True:
        order = docs[:]
        rng.shuffle(order)
        stream = [i for d in order for i in d]
        lo = rng.randrange(seq_len + 1)
        n = (len(stream) - lo) // (seq_len + 1)
        windows = torch.tensor(stream[lo : lo + n * (seq_len + 1)]).view(n, seq_len + 1)
        perm = list(range(n))
        rng.shuffle(perm)
        for k in range(0, n - batch + 1, batch):
            yield windows[perm[k : k + batch]]


def lr_at(step: int, steps: int, lr: float = LR) -> float:
    if step < WARMUP_STEPS:
        return lr * (step + 1) / WARMUP_STEPS
    t = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * t)))


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW, weight decay on the matrices but the mHC ones."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "hc" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "hc" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def recipe_command(seed: int, steps: int, threads: int, mtp_steps: int) -> str:
    """demo.json's `command`; the first stage writes mtp_steps 0, the second its own."""
    return f"dsv4 make-tiny --preset demo OUT --seed {seed} --steps {steps} --threads {threads} --mtp-steps {mtp_steps}"


class Progress:
    """One line per step on a terminal (rewritten in place), one line every `every` steps otherwise."""

    def __init__(self, steps: int, every: int = 25) -> None:
        self.steps, self.every, self.t0 = steps, every, time.monotonic()
        self.tty = sys.stdout.isatty()

    def step(self, step: int, loss: float, tokens: int, extra: str = "") -> None:
        done = step + 1
        elapsed = time.monotonic() - self.t0
        bar = "#" * (30 * done // self.steps)
        eta = elapsed / done * (self.steps - done)
        line = (
            f"[{bar:<30}] step {done}/{self.steps}  loss {loss:.3f}  {tokens / elapsed:,.0f} tok/s  "
            f"eta {eta / 60:.1f} min{extra}"
        )
        if self.tty:
            print("\r" + line, end="\n" if extra or done == self.steps else "", flush=True)
        elif extra or done % self.every == 0 or done == self.steps:
            print(line, flush=True)


def _save(model: torch.nn.Module, cfg: dict, out: Path) -> None:

    from dsv4_engine.ckpt_names import released_names
    from dsv4_engine.make_tiny import shipped, write_configs, write_safetensors

    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if "rotary_emb" in name:  # recomputed from the config, not part of a checkpoint
            continue
        for rel, r in released_names(name, t.detach()).items():
            tensors[rel] = shipped(rel, r)
    write_safetensors(tensors, out)
    write_configs(out, cfg)


def train(
    out_dir: str | Path,
    *,
    steps: int = STEPS,
    seed: int = SEED,
    batch: int = BATCH,
    seq_len: int = SEQ_LEN,
    threads: int = THREADS,
    check_corpus: bool = True,
    heldout_limit: int | None = None,
) -> Path:
    """Run the recipe's first stage; writes the checkpoint, its tokenizer, demo.json and SHA256SUMS to
    out_dir. heldout_limit: evaluate the held-out loss on the first that many windows only (the recipe
    uses all; evaluation is most of a short run's time). The second stage is mtp_train.train_mtp."""
    import torch
    from transformers import AutoTokenizer

    from dsv4_engine.tokenizer import write_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        corpus = load_corpus(check_corpus)
        cfg = config()
        write_tokenizer(out, VOCAB_SIZE, cfg["max_position_embeddings"], corpus.train)
        tok = AutoTokenizer.from_pretrained(str(out))
        docs = documents(corpus, tok)
        held = heldout_windows(corpus, tok, seq_len)[:heldout_limit]
        n_train = sum(map(len, docs))
        chars = sum(map(len, corpus.train))
        text_tokens = sum(len(d) - 2 for d in docs[: len(corpus.train)])  # the chunks, without BOS/EOS
        print(
            f"demo: {len(corpus.train)} training chunks ({chars:,} characters, {chars / text_tokens:.2f} a "
            f"token) and {len(corpus.chat)} chat turns: {n_train:,} tokens; "
            f"{len(corpus.heldout)} chunks held out ({held.shape[0]} windows of {seq_len}); "
            f"{steps} steps of {batch} x {seq_len} tokens, seed {seed}, {threads} threads",
            flush=True,
        )
        model = hf_model(cfg, seed)
        opt = adamw(model, LR)

        def logits_of(ids: torch.Tensor) -> torch.Tensor:
            return model(input_ids=ids).logits

        def heldout() -> float:
            model.eval()
            loss = mean_nll(logits_of, held)
            model.train()
            return loss

        curve = [(0, heldout())]
        print(f"held-out loss before training: {curve[0][1]:.3f} nats/token", flush=True)
        progress, rng, loss = Progress(steps), random.Random(seed), float("nan")
        model.train()
        for step, window in zip(range(steps), batches(docs, seq_len, batch, rng), strict=False):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps)
            logits = logits_of(window[:, :-1])
            loss_t = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss_t.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss = loss_t.detach().item()
            extra = ""
            if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
                curve.append((step + 1, heldout()))
                extra = f"  held-out {curve[-1][1]:.3f}"
            progress.step(step, loss, (step + 1) * batch * seq_len, extra)
        model.eval()
        _save(model, cfg, out)
        recipe = {
            "command": recipe_command(seed, steps, threads, 0),
            "corpus": "pydoc_data.topics",
            "corpus_digest": corpus_digest(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "steps": steps,
            "batch": batch,
            "seq_len": seq_len,
            "seed": seed,
            "threads": threads,
            "vocab_size": VOCAB_SIZE,
            "train_tokens": n_train,
            "characters_per_token": round(chars / text_tokens, 3),
            "heldout_loss": [[s, round(v, 4)] for s, v in curve],
            "final_train_loss": round(loss, 4),
            "indexer_trained": False,
        }
        (out / "demo.json").write_text(json.dumps(recipe, indent=2) + "\n")
        write_checksums(out)
        print(f"held-out loss {curve[0][1]:.3f} -> {curve[-1][1]:.3f} nats/token; wrote {out}", flush=True)
        return out
    finally:
        torch.set_num_threads(saved_threads)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--steps", type=int, default=STEPS, help=f"--preset demo: training steps (default {STEPS})"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=THREADS,
        help=f"--preset demo: torch threads (default {THREADS}, the bundled model's: another count changes "
        "its bytes, not its quality)",
    )
    p.add_argument(
        "--mtp-steps",
        type=int,
        default=MTP_STEPS,
        help=f"--preset demo: MTP stage steps (default {MTP_STEPS}; 0: no MTP layer)",
    )
    p.add_argument(
        "--mtp-only",
        action="store_true",
        help="--preset demo: run only the MTP stage, on the demo checkpoint already in OUT (rewritten in place)",
    )
