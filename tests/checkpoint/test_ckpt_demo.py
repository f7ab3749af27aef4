"""The bundled demo checkpoint: intact and what its recipe records; the recipe's two stages run (a few
steps: CI never trains); and bench/demo_accuracy.py's gate: this engine's held-out perplexity equals HF's on
the same weights, far below the untrained model's, and a greedy answer's words are the training text's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_engine import demo, demo_train, mtp_train

ROOT = Path(__file__).resolve().parents[2]


def test_the_bundled_demo_checkpoint_is_intact_and_records_its_recipe() -> None:
    assert demo.verify_checksums(demo.BUNDLED) == []
    listed = [line.split("  ", 1)[1] for line in (demo.BUNDLED / "SHA256SUMS").read_text().splitlines()]
    assert sorted([*listed, "SHA256SUMS"]) == sorted(p.name for p in demo.BUNDLED.iterdir())
    assert (demo.BUNDLED / "model.safetensors").stat().st_size <= 15_000_000  # 2.5 MB of it the MTP layer
    recipe = json.loads((demo.BUNDLED / "demo.json").read_text())
    assert recipe["corpus_digest"] == demo.CORPUS_DIGEST == demo.corpus_digest()
    assert (recipe["steps"], recipe["seed"], recipe["threads"]) == (demo.STEPS, demo.SEED, demo.THREADS)
    assert recipe["command"].startswith("dsv4 make-tiny --preset demo ")
    assert recipe["command"].endswith(f" --mtp-steps {demo.MTP_STEPS}")
    curve = recipe["heldout_loss"]
    assert curve[0][0] == 0 and curve[-1][0] == demo.STEPS and curve[-1][1] < curve[0][1] - 3
    mtp = recipe["mtp"]
    assert (mtp["steps"], mtp["seed"], mtp["threads"]) == (demo.MTP_STEPS, demo.SEED, demo.THREADS)
    assert mtp["heldout_loss"][-1][1] < mtp["heldout_loss"][0][1] - 2
    config = json.loads((demo.BUNDLED / "config.json").read_text())
    assert config["vocab_size"] == demo.VOCAB_SIZE and config["torch_dtype"] == "bfloat16"
    assert config["num_nextn_predict_layers"] == 1 and config["compress_ratios"][-1] == 0
    tokenizer = json.loads((demo.BUNDLED / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["vocab"]) == demo.VOCAB_SIZE  # the specials included


def test_a_damaged_copy_is_named_by_file(tmp_path: Path) -> None:
    copy = Path(shutil.copytree(demo.BUNDLED, tmp_path / "demo"))
    blob = bytearray((copy / "config.json").read_bytes())
    blob[-2] ^= 1
    (copy / "config.json").write_bytes(bytes(blob))
    (copy / "tokenizer.json").unlink()
    assert demo.verify_checksums(copy) == ["config.json", "tokenizer.json"]


def test_no_held_out_paragraph_occurs_in_the_training_text() -> None:
    corpus = demo.load_corpus()
    paragraphs = lambda chunks: {p for c in chunks for p in c.split("\n\n")}  # noqa: E731
    held = paragraphs(corpus.heldout)
    assert len(corpus.heldout) >= 10 and sum(map(len, corpus.heldout)) > 10_000
    assert not held & paragraphs(corpus.train)
    assert not held & paragraphs(a for _, a in corpus.chat)
    assert len(corpus.chat) > 200


def test_the_recipe_trains_saves_and_serves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    from dsv4_engine.llm import LLM
    from dsv4_engine.sampling_params import SamplingParams

    short = {"batch": 2, "seq_len": 32, "threads": 1, "heldout_limit": 8}
    out = demo_train.train(tmp_path / "demo", steps=2, **short)
    main = load_file(str(out / "model.safetensors"))
    mtp_train.train_mtp(out, steps=2, **short)
    printed = capsys.readouterr().out
    assert "(8 windows of 32)" in printed
    again = demo_train.train(tmp_path / "again", steps=2, **short)
    mtp_train.train_mtp(again, steps=2, **short)
    assert (again / "SHA256SUMS").read_text() == (out / "SHA256SUMS").read_text()  # seeded: the same bytes
    assert re.search(r"step 2/2 +loss \d+\.\d+ .*held-out \d+\.\d+", printed), printed
    assert re.search(r"held-out loss \d+\.\d+ -> \d+\.\d+ nats/token", printed), printed
    assert re.search(r"MTP held-out loss \d+\.\d+ -> \d+\.\d+ nats/token; t\+2 accuracy \d", printed), printed
    recipe = json.loads((out / "demo.json").read_text())
    assert [s for s, _ in recipe["heldout_loss"]] == [0, 2] and recipe["steps"] == 2
    assert [s for s, _ in recipe["mtp"]["heldout_loss"]] == [0, 2] and recipe["command"].endswith(
        " --mtp-steps 2"
    )
    assert demo.verify_checksums(out) == []
    stored = load_file(str(out / "model.safetensors"))  # the MTP stage added its layer, touched nothing else
    assert {k for k in stored if k not in main} == {k for k in stored if k.startswith("mtp.0.")} != set()
    assert all(torch.equal(stored[k], main[k]) for k in main)
    reply = LLM(out).generate(["The"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert len(reply.token_ids) == 3


@pytest.mark.timeout(300)
def test_demo_accuracy_gate_engine_equals_hf_and_the_answer_is_training_text() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "demo_accuracy.py"), "--tokens", "128", "--windows", "6"],
        capture_output=True, text=True, env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    engine = re.search(r"\| demo \| this engine \| (\d+\.\d+) \| HF (\d+\.\d+) \|", out)
    untrained = re.search(r"\| untrained \(recipe step 0\) \| HF transformers \| (\d+\.\d+) \|", out)
    assert engine and untrained, out
    ours, hf = float(engine.group(1)), float(engine.group(2))
    assert abs(ours / hf - 1) <= 1e-4
    assert float(untrained.group(1)) > 10 * hf  # a trained model, not a random one
    gap = re.search(r"\|engine/HF - 1\| = (\S+) \(gate: 1e-4\)", out)
    assert gap and float(gap.group(1)) <= 1e-4, out
    share = re.search(r"(\d+)% of its words in the training text", out)
    assert share and int(share.group(1)) >= 70, out
