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
  warm-up and cosine decay, next-token loss on windows of SEQ_LEN tokens, seeded;
- then the MTP layer (mtp_train.py), MTP_STEPS steps on the same windows, the main model frozen.
The lightning indexer gets no gradient from the next-token loss (its top-k is not differentiable) and
DeepSeek's KL loss towards the main attention is not trained here, so CSA picks its compressed rows
with random indexer weights: the model learned to read what it is given.

Torch's CPU kernels are deterministic for a fixed thread count, so the same torch version and
--threads reproduce the bundled bytes. The checkpoint is written in bf16, as DeepSeek ships
(`make_tiny.shipped`), with `demo.json` (the recipe, its losses) and `SHA256SUMS`.

This module is the recipe's constants, corpus and model, and the bundled checkpoint's check;
demo_train.py runs the recipe, mtp_train.py its second stage.
"""

from __future__ import annotations

import hashlib
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing this module (dsv4 up finds the bundled checkpoint here) must not need torch
    import torch

BUNDLED = Path(__file__).with_name("data") / "demo"
CORPUS_DIGEST = "6061bdb5e47e53fb"  # sha256 (16 hex) of CPython 3.11's topics, which the bundled model saw
VOCAB_SIZE = 1536  # 2048 would take the committed bf16 checkpoint past its budget (15 MB with the MTP layer)
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
MTP_STEPS = 300  # the second stage: the MTP layer on the frozen main model (3 epochs of the documents)
MTP_LR = 4e-3
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


# ---- tokens and the model -----------------------------------------------------------------------


def heldout_windows(corpus: Corpus, tok: object, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """[n, seq_len + 1] token ids: the held-out chunks (BOS text EOS) back to back, cut in windows."""
    import torch

    eos = tok.eos_token_id  # type: ignore[attr-defined]
    ids = [i for chunk in corpus.heldout for i in tok(chunk)["input_ids"] + [eos]]  # type: ignore[operator]
    n = len(ids) // (seq_len + 1)
    return torch.tensor(ids[: n * (seq_len + 1)]).view(n, seq_len + 1)


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


def config() -> dict:
    from dsv4_engine.make_tiny import build_config

    cfg = build_config("tiny", overrides={"vocab_size": VOCAB_SIZE})
    cfg["torch_dtype"] = "bfloat16"
    return cfg


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


# ---- the checkpoint ---------------------------------------------------------------------------------


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


def bundled() -> Path:
    """The committed demo checkpoint, after checking its files against SHA256SUMS."""
    if bad := verify_checksums(BUNDLED):
        raise RuntimeError(f"the bundled demo checkpoint in {BUNDLED} is damaged: {', '.join(bad)} differ")
    return BUNDLED
