"""The bundled demo model's accuracy, one run: held-out perplexity through this engine and through HF
transformers on the same weights, beside the recipe's untrained start, and a greedy answer's words.

    python bench/demo_accuracy.py                 # the bundled checkpoint (dsv4_engine/data/demo)
    python bench/demo_accuracy.py --model DIR     # another `dsv4 make-tiny --preset demo` output

Perplexity is exp(mean next-token loss) over the held-out chunks of the recipe's corpus, cut into
windows of 256 tokens, each window a fresh sequence; both models run in fp32 on the bf16 weights,
HF's indexer top-k made stable on ties as in the parity tests. The untrained model is the recipe's
step 0 (HF's initialisation, same seed), scored by HF only. The greedy answer is LLM.generate on the
chat template; its words are checked against the training text.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

from dsv4_engine import demo
from dsv4_engine.config import Dsv4Config
from dsv4_engine.loader import load_checkpoint
from dsv4_engine.model import Dsv4ForCausalLM, ForwardBatch
from dsv4_engine.testing import dense_cache, hf_stable_topk, load_hf

QUESTION = 'What is the "try" statement?'


def engine_nll(path: Path, windows: torch.Tensor) -> float:
    model = Dsv4ForCausalLM(Dsv4Config.from_pretrained(path), max_positions=windows.shape[1]).float()
    load_checkpoint(model, path, dtype=None, progress=False)
    model.eval()

    def logits_of(ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(ForwardBatch.build([(dense_cache(model), ids[0].tolist())]))
            return model.compute_logits(hidden)[None]

    return demo.mean_nll(logits_of, windows)


def hf_nll(model: torch.nn.Module, windows: torch.Tensor) -> float:
    with hf_stable_topk():
        return demo.mean_nll(lambda ids: model(input_ids=ids).logits, windows)


def answer(path: Path, tokens: int) -> str:
    from dsv4_engine.llm import LLM
    from dsv4_engine.sampling_params import SamplingParams

    llm = LLM(str(path), dtype="float32")
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return llm.generate([list(prompt)], params)[0].text


def in_training(text: str, vocabulary: set[str]) -> float:
    found = demo.words(text)
    return sum(w in vocabulary for w in found) / max(1, len(found))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="checkpoint (default: the bundled demo, checksums verified)")
    p.add_argument("--tokens", type=int, default=256, help="greedy answer length")
    p.add_argument("--windows", type=int, default=0, help="score only the first N held-out windows (0: all)")
    a = p.parse_args(argv)
    path = a.model or demo.bundled()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    corpus = demo.load_corpus()
    windows = demo.heldout_windows(corpus, tok)
    if a.windows:
        windows = windows[: a.windows]
    chars = sum(map(len, corpus.heldout))
    text_tokens = sum(len(tok(c)["input_ids"]) - 1 for c in corpus.heldout)  # without BOS
    n_tokens = windows.shape[0] * (windows.shape[1] - 1)
    ours, hf = engine_nll(path, windows), hf_nll(load_hf(path), windows)
    untrained = hf_nll(demo.hf_model(demo.config(), demo.SEED).eval(), windows)
    text = answer(path, a.tokens)
    share = in_training(text, demo.training_words(corpus))

    print(
        f"\ndemo_accuracy: {path}; held-out: {len(corpus.heldout)} chunks, {windows.shape[0]} windows of "
        f"{windows.shape[1] - 1} tokens ({chars / text_tokens:.2f} characters a token); fp32\n"
    )
    print("| model | path | held-out perplexity | reference | ratio |")
    print("|---|---|---:|---:|---:|")
    print(
        f"| demo | this engine | {math.exp(ours):.4f} | HF {math.exp(hf):.4f} | {math.exp(ours - hf):.6f} |"
    )
    print(f"| demo | HF transformers | {math.exp(hf):.4f} | | |")
    print(
        f"| untrained (recipe step 0) | HF transformers | {math.exp(untrained):.2f} | demo {math.exp(hf):.2f} | "
        f"{math.exp(untrained - hf):.1f}x |"
    )
    print(f"\n{n_tokens} held-out tokens; |engine/HF - 1| = {abs(math.expm1(ours - hf)):.2e} (gate: 1e-4)")
    print(
        f"\ngreedy answer to {QUESTION!r}, {a.tokens} tokens ({share:.0%} of its words in the training text):"
    )
    print(text)
    return 0 if abs(math.expm1(ours - hf)) <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
