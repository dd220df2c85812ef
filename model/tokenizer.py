"""The k3serve tokenizer: a thin, typed wrapper over a Hugging Face tokenizer directory.

Two backends, picked by `Tokenizer.from_dir`:

* `tokenizer.json`, through the `tokenizers` library (the tiny test tokenizer, converted models);
* Kimi's `tiktoken.model` (one `base64(token_bytes) rank` line per token) through `tiktoken`,
  imported only then. Its special tokens are `tokenizer_config.json`'s `added_tokens_decoder`;
  ids between the base vocabulary and the last named special are `<|reserved_token_{id}|>`, as in
  Kimi's `tokenization_kimi.py` (so Kimi-K2/Kimi-Linear load with vocab_size 163840).

Special tokens in the text (e.g. `<|im_end|>`) always encode to their single id, as Kimi's
tokenizer does. `convert_ids_to_bytes` gives each token's raw bytes for incremental detokenizing.
`train_tiny_tokenizer` writes a small, real, deterministic byte-level BPE tokenizer for tests.

Chats render in the vocabulary's format: Kimi K3's XTML (model/xtml_chat.py) when the special tokens have its
`<|open|>`, `<|close|>` and `<|sep|>` (K3 ships no Jinja template), else the directory's template or Kimi K2's.
"""

from __future__ import annotations

import base64
import json
import re
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .chat_template import KIMI_CHAT_TEMPLATE, KIMI_SPECIAL_TOKENS, normalize_messages, render_jinja, render_kimi_chat
from .xtml_chat import END_OF_MESSAGE, K3_SPECIAL_TOKENS, Segment, chat_segments, render_text

__all__ = ["Tokenizer", "train_tiny_tokenizer", "train_bpe_tokenizer", "KIMI_PAT_STR", "TINY_CORPUS_MODULES"]

# Kimi's pre-tokenizer split pattern (tokenization_kimi.py `pat_str`): Han runs stay whole.
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte value as one printable unicode character."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _token_name(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json (a string or an AddedToken dict) as its text."""
    return value.get("content") if isinstance(value, Mapping) else value


class _HFBackend:
    """tokenizer.json through the `tokenizers` library."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        self.tok = _RustTokenizer.from_file(str(path))
        added = self.tok.get_added_tokens_decoder()
        self.special = {t.content: i for i, t in added.items() if t.special}
        self.added_text = {i: t.content for i, t in added.items()}  # stored as text, not byte-level
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._bytes: list[bytes] | None = None
        names = sorted(self.special, key=len, reverse=True)  # the longest first, where two start at one place
        self._special_spelling = re.compile("|".join(map(re.escape, names))) if names else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: only it releases the GIL while it encodes, so a long prompt tokenized on the
        # ingress's worker thread leaves its event loop running (cluster/api/prepare_lane.py)
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_plain(self, text: str) -> list[int]:
        """`text` as ordinary tokens even where it spells a special token: such a spelling is encoded as two
        pieces (all of it but its last character, then that), which no added token matches."""
        if self._special_spelling is None:
            return self.encode(text, False)
        ids, start = [], 0
        for match in self._special_spelling.finditer(text):
            ids += self.encode(text[start:match.start()], False) if match.start() > start else []
            ids += self.encode(match.group()[:-1], False) + self.encode(match.group()[-1], False)
            start = match.end()
        return ids + (self.encode(text[start:], False) if start < len(text) else [])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self) -> list[bytes]:
        if self._bytes is None:
            dec = {c: b for b, c in _bytes_to_unicode().items()}
            table = [b""] * self.vocab_size
            for token, i in self.tok.get_vocab(with_added_tokens=True).items():
                if i in self.added_text:
                    table[i] = self.added_text[i].encode("utf-8")
                elif all(c in dec for c in token):
                    table[i] = bytes(dec[c] for c in token)
                else:
                    raise ValueError(f"token {i} ({token!r}) is not byte-level BPE; raw token bytes are unknown")
            self._bytes = table
        return self._bytes


class _TiktokenBackend:
    """Kimi's tiktoken.model + the added_tokens_decoder of tokenizer_config.json."""

    def __init__(self, path: Path, config: Mapping[str, Any]) -> None:
        try:
            import tiktoken
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(f"{path} is a tiktoken vocabulary: `pip install tiktoken` (k3serve[tiktoken])") from e
        ranks: dict[bytes, int] = {}
        for n, line in enumerate(path.read_bytes().splitlines(), 1):
            if line.strip():
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: expected 'base64_token rank', got {line[:80]!r}") from e
        num_base = len(ranks)
        if sorted(ranks.values()) != list(range(num_base)):
            raise ValueError(f"{path}: ranks must be exactly 0..{num_base - 1}")
        named = {int(i): _token_name(t) for i, t in config.get("added_tokens_decoder", {}).items()}
        if any(i < num_base for i in named):
            raise ValueError(f"{path}: added token ids must follow the {num_base} base tokens")
        end = max(named, default=num_base - 1) + 1
        self.special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base, end)}
        self.num_base = num_base
        self.vocab_size = end
        self.enc = tiktoken.Encoding(name=path.parent.name or "tiktoken", pat_str=config.get("pat_str", KIMI_PAT_STR),
                                     mergeable_ranks=ranks, special_tokens=self.special)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def encode_plain(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        ids = [i for i in ids if i < self.num_base] if skip_special_tokens else list(ids)
        return self.enc.decode(ids)

    def token_bytes(self) -> list[bytes]:
        return [self.enc.decode_single_token_bytes(i) for i in range(self.vocab_size)]


class Tokenizer:
    """Encode/decode text, render Kimi chats, and expose each token's raw bytes."""

    def __init__(self, backend: _HFBackend | _TiktokenBackend, config: Mapping[str, Any],
                 chat_template: str | None, extra_stop_ids: Sequence[int] = ()) -> None:
        self._backend = backend
        self.config = dict(config)
        self.chat_template = chat_template
        self.special_tokens: dict[str, int] = dict(backend.special)
        # Kimi's defaults, when the config names none: [BOS] / [EOS]
        self.bos_token: str | None = _token_name(config.get("bos_token")) or (
            "[BOS]" if "[BOS]" in backend.special else None)
        self.eos_token: str | None = _token_name(config.get("eos_token")) or (
            "[EOS]" if "[EOS]" in backend.special else None)
        self._add_bos = bool(config.get("add_bos_token", False))
        stops = [self.eos_token_id, self.special_tokens.get("<|im_end|>"), self.special_tokens.get(END_OF_MESSAGE),
                 *extra_stop_ids]
        self.stop_token_ids: frozenset[int] = frozenset(i for i in stops if i is not None)
        self._bytes: list[bytes] | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load `path/tokenizer.json`, or else `path/tiktoken.model`, with `tokenizer_config.json`."""
        path = Path(path)
        cfg_path = path / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        if (path / "tokenizer.json").is_file():
            backend: _HFBackend | _TiktokenBackend = _HFBackend(path / "tokenizer.json")
        elif (path / "tiktoken.model").is_file():
            backend = _TiktokenBackend(path / "tiktoken.model", config)
        else:
            raise FileNotFoundError(f"{path}: neither tokenizer.json nor tiktoken.model found")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        stops: list[int] = []
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text(encoding="utf-8")).get("eos_token_id")
            stops = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(backend, config, template, stops)

    # ---- vocabulary ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, special tokens included."""
        return self._backend.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self.special_tokens.get(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.special_tokens.get(self.eos_token) if self.eos_token else None

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    def special_token_id(self, token: str) -> int:
        """The id of a special token such as "<|im_end|>"; KeyError naming it when absent."""
        try:
            return self.special_tokens[token]
        except KeyError:
            raise KeyError(f"{token!r} is not a special token of this tokenizer") from None

    # ---- text ---------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. add_special_tokens: the tokenizer's own rule (tokenizer.json's
        post-processor; for tiktoken, prepend BOS iff tokenizer_config says add_bos_token).
        Kimi's tokenizers add nothing either way."""
        ids = self._backend.encode(text, add_special_tokens)
        if add_special_tokens and self._add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self._backend.decode(ids, skip_special_tokens)

    def convert_ids_to_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's raw bytes; b"".join(...) is the UTF-8 the tokens stand for."""
        if self._bytes is None:
            self._bytes = self._backend.token_bytes()
        return [self._bytes[i] for i in ids]

    token_bytes = convert_ids_to_bytes  # the name engine/detokenizer.py's TokenBytes protocol uses

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Alias of special_token_ids (the Hugging Face name, read by the incremental detokenizer)."""
        return self.special_token_ids

    # ---- chat ---------------------------------------------------------------------------------
    @property
    def chat_format(self) -> str:
        """"kimi_k3" for a vocabulary with K3's XTML special tokens, else "kimi_k2"."""
        return "kimi_k3" if all(t in self.special_tokens for t in K3_SPECIAL_TOKENS[2:6]) else "kimi_k2"

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The prompt text for `messages` ({"role", "content", optional "name", "tool_calls",
        "tool_call_id"}). Content: a string or a list of {"type": "text", "text"} parts (other
        part types: ValueError). K3's vocabulary: its XTML prompt (`template_kwargs` are
        xtml_chat.chat_segments' keywords). Else the directory's chat_template through jinja2 when
        both exist (`template_kwargs` go to the template), else the built-in Kimi renderer
        (identical output for the Kimi template), which takes no `template_kwargs` (ValueError)."""
        if self.chat_format == "kimi_k3":
            return render_text(self.chat_segments(messages, add_generation_prompt, tools, **template_kwargs))
        msgs = normalize_messages(messages)
        if self.chat_template is not None and self.chat_template != KIMI_CHAT_TEMPLATE:
            try:
                return render_jinja(self.chat_template, msgs, add_generation_prompt, tools,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "", **template_kwargs)
            except ImportError:
                warnings.warn("jinja2 is not installed: rendering the chat with the built-in Kimi format")
        if template_kwargs:
            raise ValueError(f"the Kimi K2 chat template reads no {', '.join(sorted(template_kwargs))}")
        return render_kimi_chat(msgs, add_generation_prompt, tools)

    def chat_segments(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                      tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> list[Segment]:
        """K3's prompt of `messages` as segments (xtml_chat.chat_segments)."""
        return chat_segments(normalize_messages(messages), tools, add_generation_prompt=add_generation_prompt,
                             **template_kwargs)

    def encode_segments(self, segments: Sequence[Segment]) -> list[int]:
        """Token ids of K3 prompt segments: a markup segment is its special token's id, any other is encoded on
        its own as plain text (a special token's spelling in it stays text)."""
        ids: list[int] = []
        for text, markup in segments:
            ids += [self.special_token_id(text)] if markup else self._backend.encode_plain(text)
        return ids

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> list[int]:
        """Token ids of the chat prompt: the markers become their single special ids (K3: segment by segment)."""
        if self.chat_format == "kimi_k3":
            return self.encode_segments(self.chat_segments(messages, add_generation_prompt, tools, **template_kwargs))
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs))


# ---- the tiny test tokenizer --------------------------------------------------------------------

# Training text: the docstrings of these standard-library modules and of their public classes and
# functions, in this order. Always installed, offline, deterministic for one Python version.
TINY_CORPUS_MODULES = (
    "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "enum", "fractions", "functools", "heapq", "json", "logging",
    "pathlib", "pprint", "queue", "random", "shlex", "shutil", "statistics", "string", "tempfile",
    "textwrap", "threading", "unittest", "urllib.parse", "uuid", "zipfile",
)


def _stdlib_docstrings() -> list[str]:
    import importlib
    import inspect

    docs = []
    for name in TINY_CORPUS_MODULES:
        mod = importlib.import_module(name)
        docs.append(inspect.getdoc(mod) or "")
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if not attr.startswith("_") and getattr(obj, "__module__", None) == name and (
                inspect.isclass(obj) or inspect.isfunction(obj)
            ):
                docs.append(inspect.getdoc(obj) or "")
    docs = [d for d in docs if d]
    if sum(map(len, docs)) < 50_000:
        raise RuntimeError("too little docstring text to train on (is Python running with -OO?)")
    return docs


def train_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512, model_max_length: int = 8192,
                         chat_format: str = "kimi_k2") -> None:
    """`train_bpe_tokenizer` on the docstrings of TINY_CORPUS_MODULES: the test tokenizer."""
    train_bpe_tokenizer(out_dir, _stdlib_docstrings(), vocab_size, model_max_length, chat_format)


def train_bpe_tokenizer(out_dir: str | Path, texts: Iterable[str], vocab_size: int, model_max_length: int = 8192,
                        chat_format: str = "kimi_k2") -> None:
    """Train a real byte-level BPE tokenizer (Kimi's split pattern, the special tokens of
    `chat_format` as the last ids: Kimi K2's with its chat template, or K3's, which has none) on
    `texts` and write tokenizer.json, tokenizer_config.json and special_tokens_map.json
    to `out_dir`. `vocab_size` counts everything (past the corpus's merges, reserved tokens fill it).
    The same texts give the same bytes every run."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as _RustTokenizer

    specials = list(K3_SPECIAL_TOKENS if chat_format == "kimi_k3" else KIMI_SPECIAL_TOKENS)  # in id order
    n_base = vocab_size - len(specials)
    if n_base < 256:
        raise ValueError(f"vocab_size must be at least {256 + len(specials)} (256 bytes + {len(specials)} specials)")
    tok = _RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_base, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # a vocabulary larger than the corpus's merges (k3-rank-slice: 20480) is filled up with reserved tokens
    reserved = [f"<|reserved_token_{i}|>" for i in range(n_base - tok.get_vocab_size())]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in reserved])
    if tok.get_vocab_size() != n_base:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {n_base}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert tok.get_vocab_size() == vocab_size

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    named = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}
    extra = [t for t in specials if t not in named.values()]
    config = {
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": True}
            for t in specials
        },
        **named,
        "additional_special_tokens": extra,
        "add_bos_token": False,
        **({} if chat_format == "kimi_k3" else {"chat_template": KIMI_CHAT_TEMPLATE}),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(
        json.dumps({**named, "additional_special_tokens": extra}, indent=2) + "\n", encoding="utf-8")
