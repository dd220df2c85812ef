"""`find_lone_surrogate(data)`: where a parsed JSON body holds text that is not valid Unicode.

JSON's `"\ud800"` (an escape of half a surrogate pair, or UTF-8 bytes of one, which Python's json decoder lets
through) parses into a Python str that no UTF-8 consumer takes: the tokenizer raises a TypeError deep inside, a
500. The ingress refuses it at validation instead, as a 400 naming the field (protocol.py). One pass over every
string of the body, keys included: an ASCII string is skipped at once, any other is encoded to UTF-8 (C speed; the
encoder stops at the first surrogate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class LoneSurrogate:
    loc: tuple[str | int, ...]  # the field's path in the body: ("messages", 0, "content"); a key's: its object's
    index: int  # of the character in that string
    code_point: int
    in_key: bool  # the string is a key of that object (e.g. of logit_bias), not a value

    def message(self) -> str:
        where = "a key" if self.in_key else "the text"
        return (f"{where} holds a lone surrogate (U+{self.code_point:04X}) at character {self.index}: "
                "text must be valid Unicode (send a whole surrogate pair, or the character itself)")


def find_lone_surrogate(data: Any) -> LoneSurrogate | None:
    """The first lone surrogate in `data` (dicts, lists, strings as json.loads makes them; anything else has no
    text), depth first in document order; None when every string is valid Unicode. Iterative: a body nested as
    deep as the JSON decoder allows costs no recursion here."""
    todo: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while todo:
        value, loc = todo.pop()
        if isinstance(value, str):
            texts = [(value, False)]
        elif isinstance(value, dict):  # its keys now, its values in turn
            texts = [(key, True) for key in value if isinstance(key, str)]
            todo.extend((v, (*loc, k)) for k, v in reversed(value.items()))
        else:
            texts = []
            if isinstance(value, (list, tuple)):
                todo.extend((v, (*loc, i)) for i, v in reversed(list(enumerate(value))))
        for text, in_key in texts:
            found = _in_text(text, loc, in_key)
            if found is not None:
                return found
    return None


def _in_text(text: str, loc: tuple[str | int, ...], in_key: bool) -> LoneSurrogate | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # only a surrogate stops the UTF-8 encoder
        return LoneSurrogate(loc, e.start, ord(text[e.start]), in_key)
    return None
