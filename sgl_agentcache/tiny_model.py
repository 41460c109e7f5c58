"""Write a tiny random-weight Llama model directory for CPU serving and tests.

The directory holds a Llama ``config.json`` (``tiny``: hidden 64, 2 layers, 4 heads, 2 KV heads; see
:data:`SHAPES`), a byte-level
BPE tokenizer trained locally on a fixed corpus, a ``tokenizer_config.json`` with a chat template, and
``generation_config.json``. Weights are never written: serve it with ``--load-format dummy``.
Nothing is downloaded; the output is deterministic for a given ``vocab_size``.

The model's vocabulary equals the tokenizer's, so every sampled id decodes and every id a test draws
below :data:`TinyModel.vocab_size` is valid (SGLang 0.5.23 does not range-check input ids: an id at or
above the vocab size kills the server).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
# Plain messages render as "<s>role: content</s>"; with ``tools`` the schema joins the system block (as
# in Qwen/Hermes-style templates), and an assistant's tool calls render after its content, so chat
# clients that use tools get real, distinct prompts (the chat inference tests need both).
_CHAT_TEMPLATE = (
    "{% if tools %}<s>system: {% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }} "
    "{% endif %}tools: {{ tools | tojson }}</s>{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<s>{{ m['role'] }}: {{ m['content'] if m['content'] is not none else '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
# Enough distinct text for a few hundred merges; agent vocabulary so demo prompts tokenise compactly.
_CORPUS = [
    "the quick brown fox jumps over the lazy dog. hello world! ",
    "agent tool call result user assistant system cache prefix radix tree session branch ",
    "search the repository, read the file, run the tests, summarise the observation. ",
    "0123456789 {}[]():;,.?!'\"-_/\\ ",
]


@dataclass(frozen=True)
class TinyModel:
    """What :func:`make_tiny_model` wrote."""

    path: Path
    vocab_size: int
    has_tokenizer: bool


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line * 4 for line in _CORPUS] * 50, trainer)
    assert tok.token_to_id("<s>") == BOS_ID and tok.token_to_id("</s>") == EOS_ID
    return tok


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


#: Model shapes: ``tiny`` for tests (prefill is nearly free), ``bench`` for wall-time benchmarks on CPU
#: (wide and deep enough that recomputing a prefix shows in latency, still a few seconds per 1k tokens).
SHAPES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16},
    "bench": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 64},
}


def make_tiny_model(out_dir: str | Path, *, vocab_size: int = 512, with_tokenizer: bool = True,
                    shape: str = "tiny") -> TinyModel:
    """Create (or overwrite) a random-weight Llama model directory at ``out_dir`` (``shape``: a key of
    :data:`SHAPES`; served with ``--load-format dummy``).

    With ``with_tokenizer=False`` only the config is written (serve with ``--skip-tokenizer-init``
    and send ``input_ids``); the vocab is then exactly ``vocab_size``.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size
    if with_tokenizer:
        tok = _train_tokenizer(vocab_size)
        tok.save(str(out / "tokenizer.json"))
        vocab = tok.get_vocab_size()
        _write_json(out / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
            "model_max_length": 2048, "add_bos_token": False,
            "chat_template": _CHAT_TEMPLATE,
        })
        _write_json(out / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    _write_json(out / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPES[shape],
        "vocab_size": vocab, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    })
    _write_json(out / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID})
    return TinyModel(path=out, vocab_size=vocab, has_tokenizer=with_tokenizer)
