"""Specification of k3serve's tokenizer: both backends, Kimi's special tokens and chat format,
raw token bytes, and the deterministic tiny tokenizer used by the other tests."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3serve.model.chat_template import DEFAULT_SYSTEM_PROMPT, KIMI_CHAT_TEMPLATE, KIMI_SPECIAL_TOKENS
from k3serve.model.tokenizer import Tokenizer, train_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café 東京 🙂",
    "  leading spaces, tabs\tand\n\nnewlines; digits 1234567890 and don't / we'll  ",
]
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    train_tiny_tokenizer(out, vocab_size=512)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def tiktoken_dir(tiny, tmp_path_factory) -> Path:
    """A Kimi-style tiktoken directory: the tiny tokenizer's 489 byte-level BPE tokens as
    `base64 rank` lines, and some special tokens in added_tokens_decoder with gaps between them."""
    pytest.importorskip("tiktoken")
    out = tmp_path_factory.mktemp("tiktoken")
    n_base = tiny.vocab_size - len(tiny.special_tokens)
    lines = [f"{base64.b64encode(b).decode()} {i}" for i, b in enumerate(tiny.convert_ids_to_bytes(range(n_base)))]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    names = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
    config = {
        "added_tokens_decoder": {str(n_base + 2 * k): {"content": t, "special": True} for k, t in enumerate(names)},
        "bos_token": "[BOS]",
        "eos_token": {"content": "[EOS]"},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tiktoken_tok(tiktoken_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiktoken_dir)


@pytest.fixture(params=["tokenizer.json", "tiktoken.model"])
def tok(request, tiny, tiktoken_tok) -> Tokenizer:
    return tiny if request.param == "tokenizer.json" else tiktoken_tok


# ---- text --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trips(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_utf8_of_the_text(tok, text):
    ids = tok.encode(text)
    pieces = tok.convert_ids_to_bytes(ids)
    assert all(isinstance(p, bytes) and p for p in pieces)
    assert b"".join(pieces) == text.encode("utf-8")


def test_a_token_may_hold_part_of_a_character(tiny):
    """Why the engine needs bytes: "🙂" is 4 UTF-8 bytes that a tiny vocabulary cannot keep whole."""
    pieces = tiny.convert_ids_to_bytes(tiny.encode("🙂"))
    assert len(pieces) > 1
    with pytest.raises(UnicodeDecodeError):
        pieces[0].decode("utf-8")


def test_engine_aliases(tok):
    """engine/detokenizer.py reads `token_bytes(ids)` and `all_special_ids`."""
    ids = tok.encode("café 🙂")
    assert tok.token_bytes(ids) == tok.convert_ids_to_bytes(ids)
    assert tok.all_special_ids == tok.special_token_ids


def test_the_bpe_merges_text(tiny):
    text = "The function returns the value of the object."
    assert len(tiny.encode(text)) < len(text.encode("utf-8")) * 0.6


# ---- special tokens ----------------------------------------------------------------------------

def test_kimi_special_tokens_take_the_last_ids_of_the_tiny_vocabulary(tiny):
    assert tiny.vocab_size == 512
    first = 512 - len(KIMI_SPECIAL_TOKENS)
    assert tiny.special_tokens == {t: first + k for k, t in enumerate(KIMI_SPECIAL_TOKENS)}
    assert tiny.special_token_ids == frozenset(range(first, 512))
    assert (tiny.bos_token_id, tiny.eos_token_id) == (tiny.special_token_id("[BOS]"), tiny.special_token_id("[EOS]"))


@pytest.mark.parametrize("name", list(KIMI_SPECIAL_TOKENS))
def test_each_special_token_encodes_to_its_single_id(tiny, name):
    assert tiny.encode(name) == [tiny.special_token_id(name)]
    assert tiny.convert_ids_to_bytes([tiny.special_token_id(name)]) == [name.encode()]


def test_special_tokens_in_text_are_not_split(tok):
    end, user = tok.special_token_id("<|im_end|>"), tok.special_token_id("<|im_user|>")
    text = "done.<|im_end|><|im_user|>user next"
    ids = tok.encode(text)
    assert ids.count(end) == 1 and ids.count(user) == 1 and ids.index(end) + 1 == ids.index(user)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "done.user next"
    assert b"".join(tok.convert_ids_to_bytes(ids)) == text.encode()


def test_unknown_special_token_is_a_key_error(tiny):
    with pytest.raises(KeyError, match="<|nope|>"):
        tiny.special_token_id("<|nope|>")


def test_stop_tokens_are_eos_and_im_end(tok):
    assert tok.stop_token_ids == {tok.eos_token_id, tok.special_token_id("<|im_end|>")}


def test_generation_config_eos_ids_are_stop_tokens(tiny_dir, tmp_path):
    for f in tiny_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 490]}))
    assert Tokenizer.from_dir(tmp_path).stop_token_ids == {7, 490, 491}


# ---- chat --------------------------------------------------------------------------------------

def test_chat_template_of_a_two_message_conversation(tiny):
    assert tiny.apply_chat_template(CHAT, add_generation_prompt=True) == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )


def test_without_generation_prompt_the_last_message_stays_open(tiny):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ann"}]
    assert tiny.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>ann<|im_middle|>Hi"
    )


def test_list_of_text_parts_equals_string_content(tiny):
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]}]
    assert tiny.apply_chat_template(parts) == tiny.apply_chat_template(CHAT)
    assert tiny.encode_chat(parts) == tiny.encode_chat(CHAT)


def test_non_text_part_is_rejected_naming_its_type(tiny):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="image_url"):
        tiny.apply_chat_template(msgs)


def test_encode_chat_uses_single_marker_ids(tok):
    ids = tok.encode_chat(CHAT)
    assert ids == tok.encode(tok.apply_chat_template(CHAT))
    assert ids[0] == tok.special_token_id("<|im_system|>")
    assert ids[-1] == tok.special_token_id("<|im_middle|>")
    assert ids.count(tok.special_token_id("<|im_end|>")) == 3
    assert tok.decode(ids, skip_special_tokens=True) == f"system{DEFAULT_SYSTEM_PROMPT}userHiassistantHello!assistant"


CONVERSATIONS = [
    [],
    CHAT,
    [{"role": "system", "content": "S"}, *CHAT, {"role": "user", "content": "more", "name": "bob"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "functions.get_weather:0", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
     {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
     {"role": "assistant", "content": "Sunny."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_python_renderer_matches_the_published_jinja_template(tiny, messages, add_generation_prompt):
    """The built-in renderer reproduces Kimi-K2-Instruct-0905's chat_template under HF's Jinja settings."""
    pytest.importorskip("jinja2")
    from k3serve.model.chat_template import render_jinja

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for t in (None, tools):
        expected = render_jinja(KIMI_CHAT_TEMPLATE, messages, add_generation_prompt, t)
        assert tiny.apply_chat_template(messages, add_generation_prompt, tools=t) == expected


def test_a_directory_chat_template_is_rendered_with_jinja(tiny_dir, tmp_path):
    pytest.importorskip("jinja2")
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "[EOS]"}))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CHAT) == "[user]Hi[assistant]Hello![EOS]"


# ---- the tiktoken backend ----------------------------------------------------------------------

def test_tiktoken_directory_loads_with_reserved_names_in_the_gaps(tiktoken_tok):
    tok = tiktoken_tok
    assert tok.vocab_size == 489 + 13  # base ranks, then 7 named specials two ids apart
    assert tok.special_token_id("[BOS]") == 489 and tok.bos_token_id == 489
    assert tok.eos_token_id == 491
    assert tok.special_tokens["<|reserved_token_490|>"] == 490
    assert tok.special_token_id("<|im_middle|>") == 501


@pytest.mark.parametrize("text", TEXTS + ["A longer sentence about functions, objects and their values."])
def test_tiktoken_and_tokenizer_json_agree_on_the_same_vocabulary(tiny, tiktoken_tok, text):
    """Same byte-level merges and the same (Kimi) split pattern give the same ids."""
    assert tiktoken_tok.encode(text) == tiny.encode(text)


def test_tiktoken_file_with_a_bad_line_is_rejected(tmp_path):
    pytest.importorskip("tiktoken")
    (tmp_path / "tiktoken.model").write_text("IQ== 0\nnot-base64!\n")
    with pytest.raises(ValueError, match="tiktoken.model:2"):
        Tokenizer.from_dir(tmp_path)


def test_directory_without_a_vocabulary(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---- training ----------------------------------------------------------------------------------

def test_training_is_fast_and_deterministic(tiny_dir, tmp_path):
    start = time.perf_counter()
    train_tiny_tokenizer(tmp_path / "again", vocab_size=512)
    assert time.perf_counter() - start < 5.0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_training_is_deterministic_across_processes(tiny_dir, tmp_path):
    code = "import sys; from k3serve.model.tokenizer import train_tiny_tokenizer; train_tiny_tokenizer(sys.argv[1])"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, cwd=REPO)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("vocab_size", [279, 1024])
def test_vocab_size_counts_everything(tmp_path, vocab_size):
    train_tiny_tokenizer(tmp_path, vocab_size=vocab_size)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == vocab_size
    assert max(tok.special_token_ids) == vocab_size - 1


def test_too_small_a_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="at least 279"):
        train_tiny_tokenizer(tmp_path, vocab_size=278)


def test_config_files_name_the_special_tokens(tiny_dir):
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "[BOS]" and config["eos_token"] == "[EOS]"
    assert config["chat_template"] == KIMI_CHAT_TEMPLATE
    assert config["model_max_length"] == 8192
    assert {v["content"] for v in config["added_tokens_decoder"].values()} == set(KIMI_SPECIAL_TOKENS)
    special_map = json.loads((tiny_dir / "special_tokens_map.json").read_text())
    assert "<|im_middle|>" in special_map["additional_special_tokens"]
