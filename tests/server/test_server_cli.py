"""`dsv4 serve`'s flags: SGLang's and vLLM's names as aliases, help and defaults for every flag,
`--device auto`, `--chunked-prefill-size -1`, the KV budget in bytes, checks before the port is
bound, and `dsv4 --version`."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from dsv4_engine.server import main as serve_main
from dsv4_engine.server.args import build_parser, parse
from dsv4_engine.server.preflight import SettingsError, check, resolve_device


def test_sglang_and_vllm_names_are_aliases() -> None:
    ours = parse(
        [
            "--model", "m", "--tp-size", "2", "--ep-size", "2", "--max-num-seqs", "8",
            "--max-model-len", "512", "--page-size", "64", "--max-waiting", "9",
        ]
    )  # fmt: skip
    for argv in (
        [
            "--model-path", "m", "--tensor-parallel-size", "2", "--expert-parallel-size", "2",
            "--max-running-requests", "8", "--context-length", "512", "--block-size", "64",
            "--max-queued-requests", "9",
        ],
        ["--model-path", "m", "--tp", "2", "--ep", "2", "--max-running-requests", "8", "--context-length",
         "512", "--block-size", "64", "--max-queued-requests", "9"],
        ["--model", "m", "-tp", "2", "--ep-size", "2", "--max-num-seqs", "8", "--max-model-len", "512",
         "--page-size", "64", "--max-waiting", "9"],
    ):  # fmt: skip
        assert parse(argv) == ours, argv
    assert ours.engine_kwargs() == {
        "page_size": 64, "max_model_len": 512, "max_num_seqs": 8, "tp_size": 2, "ep_size": 2
    }  # fmt: skip


def test_parser_and_template_flags_take_sglang_and_vllm_names() -> None:
    default = parse(["--model", "m"])
    assert (default.tool_call_parser, default.reasoning_parser, default.chat_template) == (
        "deepseekv4", "deepseek-v4", None
    )  # fmt: skip
    vllm = parse(["--model", "m", "--tool-call-parser", "deepseek_v4", "--reasoning-parser", "deepseek_v4",
                  "--enable-auto-tool-choice", "--chat-template", "{{ messages }}"])  # fmt: skip
    assert (vllm.tool_call_parser, vllm.reasoning_parser, vllm.chat_template) == (
        "deepseek_v4", "deepseek_v4", "{{ messages }}"
    )  # fmt: skip
    for flag in ("--tool-call-parser", "--reasoning-parser"):  # another model's parser: refused
        with pytest.raises(SystemExit) as info:
            parse(["--model", "m", flag, "hermes"])
        assert info.value.code == 2


def test_new_engine_settings_reach_the_engine() -> None:
    s = parse(["--model", "m", "--max-num-batched-tokens", "4096", "--kv-cache-memory-bytes", "3Gi"])
    assert s.engine_kwargs() == {"max_num_batched_tokens": 4096, "kv_cache_memory_bytes": 3 * 2**30}
    assert parse(["--model", "m"]).engine_kwargs() == {}  # nothing given: the engine's defaults


def test_prefix_cache_file_flags() -> None:
    s = parse(["--model", "m", "--prefix-cache-dir", "d", "--prefix-cache-max-bytes", "8Gi",
               "--prefix-cache-save-interval", "30"])  # fmt: skip
    assert (s.prefix_cache_max_bytes, s.prefix_cache_save_interval) == (8 * 2**30, 30.0)
    assert parse(["--model", "m"]).prefix_cache_save_interval == 300.0
    for flag, bad in (("--prefix-cache-save-interval", "-1"), ("--prefix-cache-save-interval", "inf"),
                      ("--prefix-cache-max-bytes", "8G")):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            parse(["--model", "m", flag, bad])
        assert info.value.code == 2


@pytest.mark.parametrize(
    ("text", "value"), [("1000", 1000), ("8Gi", 8 * 2**30), ("512MiB", 512 * 2**20), ("2Ki", 2048)]
)
def test_kv_cache_memory_bytes_units(text: str, value: int) -> None:
    assert parse(["--model", "m", "--kv-cache-memory-bytes", text]).kv_cache_memory_bytes == value


@pytest.mark.parametrize("text", ["8G", "1.5Gi", "0", "-1", "8 GB", "lots"])
def test_kv_cache_memory_bytes_refuses_ambiguous_units(text: str) -> None:
    with pytest.raises(SystemExit) as info:
        parse(["--model", "m", "--kv-cache-memory-bytes", text])
    assert info.value.code == 2


def test_chunked_prefill_minus_one_means_no_per_request_cap(tiny_checkpoint: Path) -> None:
    from dsv4_engine.engine_config import UNLIMITED_CHUNK, EngineConfig
    from dsv4_engine.server import args

    assert args.UNLIMITED_CHUNK == UNLIMITED_CHUNK  # args.py keeps a copy to stay torch-free
    s = parse(["--model", str(tiny_checkpoint), "--chunked-prefill-size", "-1", "--device", "cpu"])
    assert s.engine_kwargs()["chunked_prefill_size"] == -1
    assert check(s) == s  # accepted before binding
    cfg = EngineConfig.build(s.model, device="cpu", max_position_embeddings=4096, chunked_prefill_size=-1)
    assert cfg.chunked_prefill_size is None  # the scheduler's "token budget only"
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit):
            parse(["--model", "m", "--chunked-prefill-size", bad])


def test_every_flag_has_help_and_shows_its_default() -> None:
    from dsv4_engine import engine_config as ec

    parser = build_parser()
    formatter = parser.formatter_class(prog="dsv4 serve")
    shown = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.option_strings} has no help"
        text = formatter._get_help_string(action) % {"default": action.default}
        assert "(default" in text or "(required)" in text, f"{action.option_strings}: {text}"
        shown[action.dest] = text
    # Defaults the engine decides, spelt out in the help: they must be the engine's numbers.
    assert f"{ec.DEFAULT_PAGE_SIZE})" in shown["page_size"]
    assert f"{ec.DEFAULT_MAX_MODEL_LEN}," in shown["max_model_len"]
    assert f"{ec.DEFAULT_MAX_NUM_SEQS})" in shown["max_num_seqs"]
    assert f"{ec.DEFAULT_MAX_NUM_BATCHED_TOKENS}," in shown["max_num_batched_tokens"]
    assert ec.DEFAULT_MEMORY_FRACTION == {"cpu": 0.25} and ec.DEFAULT_DEVICE_MEMORY_FRACTION == 0.8
    assert "a quarter" in shown["kv_cache_memory_bytes"] and "0.8" in shown["kv_cache_memory_bytes"]
    assert "(default: auto)" in shown["device"]


def test_device_auto_prefers_cuda_then_npu_then_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from dsv4_engine import device

    def npu_must_not_be_asked() -> bool:
        raise AssertionError("torch_npu asked about while CUDA is there")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "npu_available", npu_must_not_be_asked)
    assert resolve_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "npu_available", lambda: True)
    assert resolve_device("auto") == "npu"
    monkeypatch.setattr(device, "npu_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cuda:1") == "cuda:1"  # explicit: as given (check() verifies it is there)
    with pytest.raises(SettingsError, match="--device"):
        resolve_device("tpu")
    assert parse(["--model", "m"]).device == "auto"


class _Bound(Exception):
    """Raised where `dsv4 serve` would bind its port."""


@pytest.fixture
def no_bind(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        seen["settings"] = self.settings
        raise _Bound

    monkeypatch.setattr(serve_main.DrainingServer, "run", run)
    return seen


def _no_config(tmp_path: Path) -> list[str]:
    return ["--model", str(tmp_path)]


def _a_file(tmp_path: Path) -> str:
    (tmp_path / "file").write_text("")
    return str(tmp_path / "file")


def _bad_config(tmp_path: Path) -> list[str]:
    (tmp_path / "config.json").write_text("{not json")
    return ["--model", str(tmp_path)]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (lambda tmp, ckpt: ["--model", str(tmp / "missing")], "--model"),
        (lambda tmp, ckpt: _no_config(tmp), "--model"),
        (lambda tmp, ckpt: _bad_config(tmp), "--model"),
        (lambda tmp, ckpt: ["--model", ckpt, "--chunked-prefill-size", "100"], "--chunked-prefill-size"),
        (lambda tmp, ckpt: ["--model", ckpt, "--max-num-batched-tokens", "16"], "--max-num-batched-tokens"),
        (lambda tmp, ckpt: ["--model", ckpt, "--num-pages", "4", "--kv-cache-memory-bytes", "1Gi"],
         "--kv-cache-memory-bytes"),
        (lambda tmp, ckpt: ["--model", ckpt, "--dtype", "int3"], "--dtype"),
        (lambda tmp, ckpt: ["--model", ckpt, "--device", "tpu"], "--device"),
        # One rank until parallelism lands: a size the engine would ignore is refused (issue 17).
        (lambda tmp, ckpt: ["--model", ckpt, "--tp-size", "8"], "--tp-size"),
        (lambda tmp, ckpt: ["--model", ckpt, "--ep-size", "2"], "--ep-size"),
        (lambda tmp, ckpt: ["--model", ckpt, "--chat-template", str(tmp / "none.jinja")], "--chat-template"),
        (lambda tmp, ckpt: ["--model", ckpt, "--prefix-cache-dir", str(tmp), "--disable-radix-cache"],
         "--prefix-cache-dir"),
        (lambda tmp, ckpt: ["--model", ckpt, "--prefix-cache-dir", _a_file(tmp)], "--prefix-cache-dir"),
        (lambda tmp, ckpt: ["--model", ckpt, "--prefix-cache-max-bytes", "4Gi"], "--prefix-cache-max-bytes"),
    ],
)  # fmt: skip
def test_serve_refuses_bad_settings_before_binding(
    argv: Any,
    flag: str,
    tmp_path: Path,
    tiny_checkpoint: Path,
    no_bind: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = serve_main.main(argv(tmp_path, str(tiny_checkpoint)))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "settings" not in no_bind
    assert len(err) == 1 and err[0].startswith(f"dsv4 serve: error: {flag}:"), err


def test_serve_refuses_cuda_where_there_is_none(
    tiny_checkpoint: Path, no_bind: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serve_main.main(["--model", str(tiny_checkpoint), "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("dsv4 serve: error: --device:")


def test_serve_resolves_the_device_and_logs_it(
    tiny_checkpoint: Path,
    no_bind: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import torch

    from dsv4_engine import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "npu_available", lambda: False)
    caplog.set_level(logging.INFO, logger="dsv4.server")
    with pytest.raises(_Bound):
        serve_main.main(["--model-path", str(tiny_checkpoint), "--port", "1"])
    assert no_bind["settings"].device == "cpu"
    assert "device: cpu (from --device auto)" in caplog.text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from dsv4_operator.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dsv4 {importlib.metadata.version('dsv4')}"


@pytest.mark.parametrize(
    ("env", "want"),
    [({}, "3000"), ({"GOMP_SPINCOUNT": "5"}, "5"), ({"OMP_WAIT_POLICY": "passive"}, None)],
    ids=["default", "spin-count-set", "wait-policy-set"],
)
def test_serve_shortens_openmp_spinning_unless_told(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], want: str | None
) -> None:
    """`dsv4 serve` sets GOMP_SPINCOUNT before torch loads libgomp (docs/server.md "Threads"), leaving
    an operator's own GOMP_SPINCOUNT or OMP_WAIT_POLICY alone."""
    from dsv4_engine.cli import serve_main as cli_serve

    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        cli_serve(["--help"])
    assert exited.value.code == 0
    assert os.environ.get("GOMP_SPINCOUNT") == want
