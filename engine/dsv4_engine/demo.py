"""The demo checkpoint: the tiny architecture trained on Python's help topics, so that it writes English.

A random checkpoint answers in byte noise, and noise looks the same whether a PD transfer moved every
page or corrupted them all. This one answers a question about Python with text that reads like the
Python documentation, and a broken path shows at a glance (and in `bench/demo_accuracy.py`'s
perplexity).

The recipe, `dsv4 make-tiny --preset demo OUT`, is fixed end to end:
- corpus: `pydoc_data.topics` (the text behind `help("for")`, ~465 KB, shipped with every CPython).
  Each paragraph is kept once (topics repeat each other), the topics are cut into chunks at paragraph
  breaks, and every HOLDOUT_EVERY-th chunk is held out: no held-out paragraph occurs anywhere in the
  training text. A CPython whose topics differ from the ones the bundled model saw is refused
  (CORPUS_DIGEST);
- tokenizer: the tiny checkpoints' byte-level BPE, trained on the training chunks only (VOCAB_SIZE);
- documents: every training chunk as plain text, and for each topic a few questions naming it
  (QUESTIONS) answered, through the chat template, by the topic's opening chunk (where no paragraph of
  it is held out);
- model: the tiny preset's architecture with HF `DeepseekV4ForCausalLM`, HF's initialisation (the
  hash layers' token-to-expert table drawn as make_tiny draws it: HF leaves it zero), AdamW with
  warm-up and cosine decay, next-token loss on windows of SEQ_LEN tokens, seeded.
The lightning indexer gets no gradient from the next-token loss (its top-k is not differentiable) and
DeepSeek's KL loss towards the main attention is not trained here, so CSA picks its compressed rows
with random indexer weights: the model learned to read what it is given.

Torch's CPU kernels are deterministic for a fixed thread count, so the same torch version and
--threads reproduce the bundled bytes. The checkpoint is written in bf16, as DeepSeek ships
(`make_tiny.shipped`), with `demo.json` (the recipe, its losses) and `SHA256SUMS`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing this module (dsv4 up finds the bundled checkpoint here) must not need torch
    import torch

BUNDLED = Path(__file__).with_name("data") / "demo"
CORPUS_DIGEST = "6061bdb5e47e53fb"  # sha256 (16 hex) of CPython 3.11's topics, which the bundled model saw
VOCAB_SIZE = 1536  # 2048 would take the committed bf16 checkpoint past its 12 MB budget
HOLDOUT_EVERY = 20
CHUNK_CHARS = 1000  # a chunk closes at the first paragraph break after this many characters
SEQ_LEN = 256
BATCH = 8
STEPS = 600
LR = 2e-3
MIN_LR_FRACTION = 0.1
WARMUP_STEPS = 40
WEIGHT_DECAY = 0.1
EVAL_EVERY = 100
THREADS = 2  # the bundled model's; another count changes the bytes (reduction order), not the quality
SEED = 0
QUESTIONS = ("What is {}?", "Tell me about {}.", "Explain {}.", "How does {} work in Python?")


@dataclass(frozen=True)
class Corpus:
    train: list[str]  # chunks of topic text
    heldout: list[str]
    chat: list[tuple[str, str]]  # (question, answer), answers from the training chunks


def corpus_digest() -> str:
    import pydoc_data.topics

    blob = repr(sorted(pydoc_data.topics.topics.items())).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _chunks(text: str, seen: set[str]) -> list[str]:
    """The topic's paragraphs not in `seen` (which takes them), joined into chunks of CHUNK_CHARS or more.

    Topics repeat each other (`compound` holds the whole `for` topic): without this, a held-out chunk
    would be training text under another topic's name."""
    out, cur = [], ""
    for para in text.strip().split("\n\n"):
        if para in seen:
            continue
        seen.add(para)
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= CHUNK_CHARS:
            out.append(cur)
            cur = ""
    if cur:
        out.append(cur)
    return out


def _title(text: str) -> str:
    """'The "for" statement' (a topic's heading) as a question names it: 'the "for" statement'."""
    head = text.strip().splitlines()[0].strip()
    return head[0].lower() + head[1:] if head.startswith("The ") else head


def load_corpus(check: bool = True) -> Corpus:
    import pydoc_data.topics

    if check and (got := corpus_digest()) != CORPUS_DIGEST:
        raise RuntimeError(
            f"this Python ({platform.python_version()}) ships help topics with digest {got}; the demo "
            f"recipe and its bundled model use CPython 3.11's ({CORPUS_DIGEST})"
        )
    topics = [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]
    chunks: list[str] = []
    seen: set[str] = set()
    for text in topics:
        chunks += _chunks(text, seen)
    held = {i for i in range(len(chunks)) if i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2}
    train = [c for i, c in enumerate(chunks) if i not in held]
    heldout = [c for i, c in enumerate(chunks) if i in held]
    held_paras = {p for c in heldout for p in c.split("\n\n")}
    chat = []
    for text in topics:  # each topic's own opening, where none of it is held out
        first = _chunks(text, set())[0]
        if not held_paras & set(first.split("\n\n")):
            chat += [(q.format(_title(text)), first) for q in QUESTIONS]
    return Corpus(train, heldout, chat)


def training_words(corpus: Corpus) -> set[str]:
    """Lower-cased words of the training text (letters only): what a completion's words are checked against."""
    return set(words(" ".join(corpus.train)))


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


# ---- tokens ------------------------------------------------------------------------------------


def documents(corpus: Corpus, tok: object) -> list[list[int]]:
    """Token ids of every training document: plain chunks (BOS text EOS) and chat turns."""
    eos = tok.eos_token_id  # type: ignore[attr-defined]
    docs = [tok(chunk)["input_ids"] + [eos] for chunk in corpus.train]  # type: ignore[operator]
    for q, a in corpus.chat:
        turn = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        docs.append(list(tok.apply_chat_template(turn, tokenize=True, return_dict=False)))  # type: ignore[attr-defined]
    return docs


def heldout_windows(corpus: Corpus, tok: object, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """[n, seq_len + 1] token ids: the held-out chunks (BOS text EOS) back to back, cut in windows."""
    import torch

    eos = tok.eos_token_id  # type: ignore[attr-defined]
    ids = [i for chunk in corpus.heldout for i in tok(chunk)["input_ids"] + [eos]]  # type: ignore[operator]
    n = len(ids) // (seq_len + 1)
    return torch.tensor(ids[: n * (seq_len + 1)]).view(n, seq_len + 1)


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


def mean_nll(logits_of: Callable[[torch.Tensor], torch.Tensor], windows: torch.Tensor) -> float:
    """Mean next-token negative log-likelihood (nats) over `windows`; logits_of maps [n, T] ids to
    [n, T, vocab] logits. Perplexity is its exp."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = logits_of(w[None, :-1]).float()
            nll = torch.nn.functional.cross_entropy(logits[0], w[1:], reduction="sum")
            total, count = total + float(nll), count + w.numel() - 1
    return total / count


# ---- training ----------------------------------------------------------------------------------


def config() -> dict:
    from dsv4_engine.make_tiny import build_config

    cfg = build_config("tiny", overrides={"vocab_size": VOCAB_SIZE})
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def _lr(step: int, steps: int) -> float:
    if step < WARMUP_STEPS:
        return LR * (step + 1) / WARMUP_STEPS
    t = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * t)))


def hf_model(cfg: dict, seed: int) -> torch.nn.Module:
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from dsv4_engine.make_tiny import draw

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg))
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            buf.copy_(draw(name, tuple(buf.shape), cfg, seed))
    return model


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


def write_checksums(out: Path) -> None:
    lines = [f"{file_sha256(f)}  {f.name}\n" for f in sorted(out.iterdir()) if f.name != "SHA256SUMS"]
    (out / "SHA256SUMS").write_text("".join(lines))


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify_checksums(path: Path) -> list[str]:
    """Files under `path` whose sha256 differs from SHA256SUMS (or that are missing)."""
    bad = []
    for line in (path / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        f = path / name
        if not f.is_file() or file_sha256(f) != digest:
            bad.append(name)
    return bad


def train(
    out_dir: str | Path,
    *,
    steps: int = STEPS,
    seed: int = SEED,
    batch: int = BATCH,
    seq_len: int = SEQ_LEN,
    threads: int = THREADS,
    check_corpus: bool = True,
) -> Path:
    """Run the recipe; writes the checkpoint, its tokenizer, demo.json and SHA256SUMS to out_dir."""
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
        held = heldout_windows(corpus, tok, seq_len)
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
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "hc" not in n]
        rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "hc" not in n)]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
            lr=LR,
            betas=(0.9, 0.95),
        )

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
                g["lr"] = _lr(step, steps)
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
            "command": f"dsv4 make-tiny --preset demo OUT --seed {seed} --steps {steps} --threads {threads}",
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


def bundled() -> Path:
    """The committed demo checkpoint, after checking its files against SHA256SUMS."""
    if bad := verify_checksums(BUNDLED):
        raise RuntimeError(f"the bundled demo checkpoint in {BUNDLED} is damaged: {', '.join(bad)} differ")
    return BUNDLED
