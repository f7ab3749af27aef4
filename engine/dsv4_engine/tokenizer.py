"""The tiny checkpoints' tokenizer: byte-level BPE trained offline on a corpus bundled here.

Byte-level, so any UTF-8 text round-trips (CJK, emoji, accents). The special tokens and the chat
template follow DeepSeek's: `<｜begin▁of▁sentence｜>` (id 0, added in front of every encoding),
`<｜end▁of▁sentence｜>` (id 1), `<｜User｜>`, `<｜Assistant｜>`; `<think>`, `</think>` and
`｜DSML｜` (tool calls) are single tokens that decode as text. Training is deterministic: the corpus is
fixed text plus sentences drawn from fixed word lists with a fixed seed, independent of the model's seed.
The demo checkpoint (`dsv4_engine.demo`) trains the same tokenizer on its own corpus instead.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
# DeepSeek-V3.2/V4's tool-call marker: tags are written `<｜DSML｜tool_calls>`, `<｜DSML｜invoke name="f">`...
DSML = "｜DSML｜"
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT, THINK, END_THINK, DSML)
# Single tokens that decode as text even with skip_special_tokens (as in DeepSeek's own tokenizer), so
# the reasoning and tool-call parsers see them in the detokenised output.
TEXT_CONTROL_TOKENS = (THINK, END_THINK, DSML)

# DeepSeek-style roles: system text right after BOS, then User/Assistant turns; an assistant turn ends
# with EOS. Tools (OpenAI `tools`) are described after the system text; an assistant's `tool_calls`
# are written in DSML with their arguments as parameters (server/prompts.py hands `arguments` in as a
# dict); a `tool` message is a user turn holding `<tool_result>`. The thinking switch is SGLang's
# `thinking` or vLLM's `enable_thinking` (chat_template_kwargs): true opens `<think>` after the
# generation prompt, false closes it at once (DeepSeek's non-thinking mode), unset adds neither. With
# thinking on, `reasoning_effort` "max" (DeepSeek-V4's highest level; the server maps OpenAI's efforts
# onto it) opens the prompt with an instruction to think exhaustively, as DSV4's own encoding does.
MAX_EFFORT_INSTRUCTION = (
    "Reasoning effort: maximum. Think the problem through completely before answering: break it into "
    "parts, test each step against edge cases and alternatives, and write every step down.\n\n"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set think = thinking if thinking is defined else enable_thinking if enable_thinking is defined "
    "else none %}"
    "{%- if think is true and reasoning_effort is defined and reasoning_effort == 'max' %}"
    "{{ '" + MAX_EFFORT_INSTRUCTION.replace("\n", "\\n") + "' }}{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{{ message['content'] }}"
    "{%- endif %}{%- endfor %}"
    "{%- if tools %}"
    "{{ '\n\n## Tools\n\nTo call tools, write one block like this (several invokes are allowed):\n\n"
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$NAME" string="true|false">$VALUE</｜DSML｜parameter>\n'
    '</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nstring="true" for a string value written as it is, '
    'string="false" for any other value written as JSON.\n\n### Available tools\n\' }}'
    "{%- for tool in tools %}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}"
    "{{ '\n' }}{%- endfor %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'tool' %}{{ '<｜User｜><tool_result>' + message['content'] + '</tool_result>' }}"
    "{%- elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + (message['content'] or '') }}"
    "{%- if message['tool_calls'] %}{{ '\n\n<｜DSML｜tool_calls>\n' }}"
    "{%- for call in message['tool_calls'] %}"
    "{{ '<｜DSML｜invoke name=\"' + call['function']['name'] + '\">\n' }}"
    "{%- for key, value in call['function']['arguments'].items() %}"
    "{%- if value is string %}{{ '<｜DSML｜parameter name=\"' + key + '\" string=\"true\">' + value }}"
    "{%- else %}{{ '<｜DSML｜parameter name=\"' + key + '\" string=\"false\">' + (value | tojson) }}"
    "{%- endif %}{{ '</｜DSML｜parameter>\n' }}"
    "{%- endfor %}{{ '</｜DSML｜invoke>\n' }}"
    "{%- endfor %}{{ '</｜DSML｜tool_calls>' }}"
    "{%- endif %}{{ eos_token }}"
    "{%- else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}"
    "{%- if think is true %}{{ '<think>' }}{%- elif think is false %}{{ '</think>' }}{%- endif %}"
    "{%- endif %}"
)

_TEXT = """\
The engine serves a mixture-of-experts language model. Each request is split into a prefill, which reads
the whole prompt at once, and a decode, which produces one token at a time. Prefill is compute bound;
decode is memory bound, so the two run on different servers and the key-value cache moves between them.
Attention in this model has three kinds of layers. Sliding-window layers see the last few tokens only.
Compressed layers also see one summary row for every four tokens, chosen by a small indexer, or one row
for every hundred and twenty-eight tokens, all of them. A hyper-connection keeps four residual streams
and mixes them with a doubly stochastic matrix found by Sinkhorn iterations.
Experts are small feed-forward networks; a router scores them, adds a correction bias for balance, and
keeps the best few. The first layers route by a fixed hash of the token id instead.
Weights ship in eight-bit floating point with one scale per block of 128 by 128 values, and experts in
four-bit floating point with one power-of-two scale per 32 values. The loader turns them back into
ordinary floats on the CPU before the model runs.
def load(path):
    with open(path, "rb") as f:
        return f.read()
for i in range(10):
    print(i, i * i, {"key": [1, 2, 3]})
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 128 256 512 1024 3.14159 2.71828 -1 +1 1e-6 0x1F.
Bonjour, ça va ? Très bien, merci. Où est la gare ? Äpfel, Öl und Übermut; niño, señor, canción.
你好，世界。今天天气很好，我们去公园散步吧。模型在服务器上运行。
こんにちは、世界。日本語のテキストもバイト単位で扱えます。
Привет, мир! Как дела? Всё хорошо.
Emoji work too: 🙂 🚀 🌍 ✨ — and symbols like €, £, ¥, °, ±, ×, ÷, →, ≤, ≥.
"""

_WORD_TEXT = (
    "the a model token server request prompt cache page layer expert router score bias window stride "
    "compress index head query key value stream mix sum norm scale block weight float bit byte tensor "
    "shard file load write read fast slow small large first last next every each some many one two "
    "three four runs keeps moves sees finds turns adds chooses reads writes serves splits returns "
    "quickly slowly often never always again together apart inside outside before after during"
)


def corpus() -> list[str]:
    """The training text: the fixed paragraphs, then sentences drawn from `_WORD_TEXT` with a fixed seed."""
    rng = random.Random(20240601)
    vocabulary = _WORD_TEXT.split()
    lines = _TEXT.splitlines()
    for _ in range(600):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(4, 14))]
        lines.append(" ".join(words).capitalize() + rng.choice(".!?;,"))
    return lines


def build_tokenizer(vocab_size: int, lines: list[str] | None = None) -> Tokenizer:
    """Train the byte-level BPE with exactly `vocab_size` tokens (specials first, ids 0..7) on `lines`
    (default: the bundled corpus())."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus() if lines is None else lines, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_CONTROL_TOKENS])
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus yields {tok.get_vocab_size()} tokens, not the {vocab_size} asked for")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write_tokenizer(
    out_dir: str | Path, vocab_size: int, model_max_length: int, lines: list[str] | None = None
) -> None:
    """tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) that AutoTokenizer loads offline;
    trained on `lines` (default: the bundled corpus())."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(vocab_size, lines),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    # transformers 5 keeps the template in chat_template.jinja; other readers look in tokenizer_config.json
    config_file = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
