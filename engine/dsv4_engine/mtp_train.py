"""The demo recipe's second stage: an MTP layer (mtp_layer.py) trained on the frozen main model.

The checkpoint's main model (HF transformers, fp32 on its bf16 weights) gives each window's final
residual streams; the MTP layer, started from the main model's last layer (`init_from_main`), learns to
predict t_{i+2} from them and t_{i+1}, on the first stage's documents and batches (same seed: the same
windows in the same order), with the same optimiser and schedule. Only the MTP layer changes; it is
written beside the main tensors, which keep their bytes. The held-out windows score it twice: against
the text (t+2 accuracy) and against the main model's own greedy token there (greedy speculative
decoding accepts a draft token exactly when they agree).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from dsv4_engine.demo import (
    BATCH,
    EVAL_EVERY,
    MTP_LR,
    MTP_STEPS,
    SEED,
    SEQ_LEN,
    THREADS,
    heldout_windows,
    load_corpus,
    write_checksums,
)
from dsv4_engine.demo_train import Progress, adamw, batches, documents, lr_at, recipe_command
from dsv4_engine.loader import SINGLE_FILE
from dsv4_engine.make_tiny import shipped, write_configs, write_safetensors
from dsv4_engine.mtp_layer import (
    MtpLayer,
    init_from_main,
    load_released,
    mtp_config,
    mtp_logits,
    mtp_state,
    with_mtp,
)
from dsv4_engine.testing import load_hf


def mtp_heldout(model: torch.nn.Module, mtp: torch.nn.Module, windows: torch.Tensor) -> dict[str, float]:
    """The MTP layer on held-out windows [n, T]: its loss on t_{i+2} (nats), its accuracy (argmax ==
    t_{i+2}), its acceptance (argmax == the main model's own argmax for t_{i+2}: greedy speculative
    decoding's draft acceptance), and the main model's accuracy on the same tokens."""
    loss = hit = agree = main_hit = count = 0.0
    with torch.no_grad():
        for k in range(0, len(windows), BATCH):
            w = windows[k : k + BATCH]
            main, draft = mtp_logits(model, mtp, w)
            draft, target, greedy = draft[:, :-1], w[:, 2:], main[:, 1:].argmax(-1)
            loss += float(
                torch.nn.functional.cross_entropy(draft.flatten(0, 1), target.flatten(), reduction="sum")
            )
            guess = draft.argmax(-1)
            hit += int((guess == target).sum())
            agree += int((guess == greedy).sum())
            main_hit += int((greedy == target).sum())
            count += target.numel()
    return {
        "loss": loss / count,
        "accuracy": hit / count,
        "acceptance": agree / count,
        "main_accuracy": main_hit / count,
    }


def train_mtp(
    checkpoint_dir: str | Path,
    *,
    steps: int = MTP_STEPS,
    seed: int = SEED,
    batch: int = BATCH,
    seq_len: int = SEQ_LEN,
    threads: int = THREADS,
    check_corpus: bool = True,
    heldout_limit: int | None = None,
) -> Path:
    """The recipe's second stage on a demo checkpoint: train an MTP layer (mtp_layer.py) on the main
    recipe's batches, the main model frozen, and add it to the checkpoint in place: its main tensors keep
    their bytes; config.json, demo.json and SHA256SUMS are rewritten. A checkpoint that already has an MTP
    layer gets a new one."""
    out = Path(checkpoint_dir)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        corpus = load_corpus(check_corpus)
        tok = AutoTokenizer.from_pretrained(str(out))
        docs = documents(corpus, tok)
        held = heldout_windows(corpus, tok, seq_len)[:heldout_limit]
        cfg = json.loads((out / "config.json").read_text())
        model = load_hf(out).requires_grad_(False)  # HF ignores the mtp.* tensors of an earlier run
        mtp = MtpLayer(mtp_config(cfg))
        init_from_main(mtp, model)
        opt = adamw(mtp, MTP_LR)
        print(
            f"demo MTP stage: {steps} steps of {batch} x {seq_len} tokens, seed {seed}, {threads} threads",
            flush=True,
        )

        def heldout() -> float:
            mtp.eval()
            loss = mtp_heldout(model, mtp, held)["loss"]
            mtp.train()
            return loss

        curve = [(0, heldout())]
        print(f"MTP held-out loss before training: {curve[0][1]:.3f} nats/token", flush=True)
        progress, rng, loss = Progress(steps), random.Random(seed), float("nan")
        mtp.train()
        for step, window in zip(range(steps), batches(docs, seq_len, batch, rng), strict=False):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, MTP_LR)
            _, logits = mtp_logits(model, mtp, window)
            loss_t = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), window[:, 2:].flatten())
            opt.zero_grad(set_to_none=True)
            loss_t.backward()
            torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
            opt.step()
            loss = loss_t.detach().item()
            extra = ""
            if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
                curve.append((step + 1, heldout()))
                extra = f"  held-out {curve[-1][1]:.3f}"
            progress.step(step, loss, (step + 1) * batch * seq_len, extra)
        mtp.eval()
        # The stored weights, as the engine will read them: bf16 as shipped, back in fp32.
        stored = {k: shipped(k, v) for k, v in mtp_state(mtp).items()}
        load_released(mtp, stored)
        score = mtp_heldout(model, mtp, held)

        tensors = {k: v for k, v in load_file(str(out / SINGLE_FILE)).items() if not k.startswith("mtp.")}
        write_safetensors(tensors | stored, out)
        write_configs(out, with_mtp(cfg))
        recipe = json.loads((out / "demo.json").read_text())
        recipe["command"] = recipe_command(seed, recipe["steps"], threads, steps)
        recipe["mtp"] = {
            "steps": steps,
            "batch": batch,
            "seq_len": seq_len,
            "seed": seed,
            "threads": threads,
            "lr": MTP_LR,
            "heldout_loss": [[s, round(v, 4)] for s, v in curve],
            "final_train_loss": round(loss, 4),
            "heldout_positions": int(held.shape[0] * (held.shape[1] - 2)),
            "heldout_accuracy": round(score["accuracy"], 4),
            "heldout_acceptance": round(score["acceptance"], 4),
            "heldout_main_accuracy": round(score["main_accuracy"], 4),
        }
        (out / "demo.json").write_text(json.dumps(recipe, indent=2) + "\n")
        write_checksums(out)
        print(
            f"MTP held-out loss {curve[0][1]:.3f} -> {curve[-1][1]:.3f} nats/token; t+2 accuracy "
            f"{score['accuracy']:.1%}, agreement with the main model's greedy token {score['acceptance']:.1%} "
            f"(the main model's own accuracy there {score['main_accuracy']:.1%}); wrote {out}",
            flush=True,
        )
        return out
    finally:
        torch.set_num_threads(saved_threads)
