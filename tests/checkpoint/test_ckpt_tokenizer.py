"""The tiny checkpoints' tokenizer: loads offline, round-trips any UTF-8, renders DeepSeek-style chats."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4_engine import tokenizer as tk

TEXTS = [
    "Hello, world! The model serves 42 requests.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "你好，世界。模型在服务器上运行。",
    "Grüße, señor! Ça va? Ωμέγα — naïve café",
    "emoji 🙂🚀 and a family 👨‍👩‍👧 and e\u0301 (combining)",
    "こんにちは 안녕하세요 مرحبا שלום",
    "def f(x):\n    return {'k': [1, 2, 3]}  # code",
]


@pytest.fixture(scope="module")
def hf_tok(tiny_ckpt: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_ckpt)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(hf_tok, text: str) -> None:
    ids = hf_tok(text)["input_ids"]
    assert ids[0] == hf_tok.bos_token_id == 0
    assert all(0 <= i < len(hf_tok) for i in ids)
    assert hf_tok.decode(ids, skip_special_tokens=True) == text


def test_bpe_merges_learned(hf_tok) -> None:
    text = "The model serves the prompt and the cache."
    assert len(hf_tok(text, add_special_tokens=False)["input_ids"]) < len(text.encode()) // 2


def test_special_token_ids_match_config(hf_tok, tiny_ckpt: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_ckpt)
    assert hf_tok.convert_tokens_to_ids(tk.BOS) == cfg.bos_token_id
    assert hf_tok.convert_tokens_to_ids(tk.EOS) == cfg.eos_token_id == hf_tok.eos_token_id
    assert hf_tok.pad_token == tk.PAD
    assert len(hf_tok) == cfg.vocab_size
    # special tokens are single ids, not byte pieces
    assert len(hf_tok(tk.USER + tk.ASSISTANT, add_special_tokens=False)["input_ids"]) == 2


def test_chat_template_renders_deepseek_roles(hf_tok) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+2?"},
    ]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"{tk.BOS}Be brief.{tk.USER}Hi{tk.ASSISTANT}Hello{tk.EOS}{tk.USER}2+2?{tk.ASSISTANT}"
    ids = hf_tok.apply_chat_template(messages[1:2], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == hf_tok.bos_token_id and ids.count(hf_tok.bos_token_id) == 1
    assert ids[-1] == hf_tok.convert_tokens_to_ids(tk.ASSISTANT)


def test_chat_template_also_in_tokenizer_config(tiny_ckpt: Path) -> None:
    import json

    cfg = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == tk.CHAT_TEMPLATE


def test_training_is_deterministic() -> None:
    assert tk.build_tokenizer(512).to_str() == tk.build_tokenizer(512).to_str()


def test_too_large_vocab_is_refused() -> None:
    with pytest.raises(ValueError, match="not the 100000 asked for"):
        tk.build_tokenizer(100000)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_every_preset_vocab_is_trainable(preset: str) -> None:
    from dsv4_engine.make_tiny import PRESETS

    vocab = PRESETS[preset]["vocab_size"]
    tok = tk.build_tokenizer(vocab)
    assert tok.get_vocab_size() == vocab
    assert [tok.token_to_id(t) for t in tk.SPECIAL_TOKENS] == list(range(len(tk.SPECIAL_TOKENS)))


def test_tool_and_thinking_tokens_are_single_and_decode_as_text(hf_tok) -> None:
    for token in tk.TEXT_CONTROL_TOKENS:
        ids = hf_tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and hf_tok.decode(ids, skip_special_tokens=True) == token


def test_chat_template_renders_tools_calls_results_and_thinking(hf_tok) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    text = hf_tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, thinking=True
    )
    d = tk.DSML
    assert '"name": "get_weather"' in text.split(tk.USER)[0]  # described before the first turn
    assert (
        f'{tk.ASSISTANT}\n\n<{d}tool_calls>\n<{d}invoke name="get_weather">\n'
        f'<{d}parameter name="city" string="true">Oslo</{d}parameter>\n'
        f'<{d}parameter name="days" string="false">2</{d}parameter>\n'
        f"</{d}invoke>\n</{d}tool_calls>{tk.EOS}"
    ) in text
    assert text.endswith(f"{tk.USER}<tool_result>rain</tool_result>{tk.ASSISTANT}{tk.THINK}")
    off = hf_tok.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert off.endswith(f"{tk.ASSISTANT}{tk.END_THINK}")
