"""Checkpoints shared by the checkpoint tests: written once per session (make-tiny takes seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsv4_engine.testing import one_thread

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here must work without a network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs torch on one thread (see dsv4_engine.testing.one_thread)."""


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4_engine.make_tiny import make_tiny

    with one_thread():
        return make_tiny(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsv4_engine.make_tiny import make_tiny

    with one_thread():
        return make_tiny(tmp_path_factory.mktemp("tiny_fp8") / "ckpt", seed=0, quant="fp8")


@pytest.fixture(scope="session")
def tiny_w8a8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model in the Ascend W8A8 layout, written through `dsv4 make-tiny`'s own flags."""
    from dsv4_engine.make_tiny import main

    out = tmp_path_factory.mktemp("tiny_w8a8") / "ckpt"
    with one_thread():
        assert main([str(out), "--seed", "0", "--quant", "w8a8"]) == 0
    return out


@pytest.fixture(scope="session")
def hf_tiny(tiny_ckpt: Path):
    """HF transformers' own model, loaded by HF from the tiny checkpoint (the independent reference)."""
    from transformers import AutoModelForCausalLM

    with one_thread():
        return AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
