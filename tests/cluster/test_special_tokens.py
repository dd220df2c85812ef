"""Special tokens found in streamed text (cluster/api/special_tokens.py): one lexer a vocabulary, shared by every
choice and both parsers, and a reader a choice that carries the possible start of a token to the next delta."""

from __future__ import annotations

from k3serve.cluster.api.special_tokens import SpecialTokenReader, lexer_for
from k3serve.model.chat_template import KIMI_SPECIAL_TOKENS


def test_one_lexer_a_vocabulary_object():
    vocabulary = dict(KIMI_SPECIAL_TOKENS)
    assert lexer_for(vocabulary) is lexer_for(vocabulary)
    assert lexer_for(dict(KIMI_SPECIAL_TOKENS)) is not lexer_for(vocabulary)  # another tokenizer's: its own


def test_the_parsers_markers_are_tokens_even_outside_the_vocabulary():
    pieces, held_back = lexer_for(["<|im_end|>"]).split("a<think>b</think><|tool_call_end|><|im_end|>c<|tool")
    assert pieces == [("a", False), ("<think>", True), ("b", False), ("</think>", True),
                      ("<|tool_call_end|>", True), ("<|im_end|>", True), ("c", False)]
    assert held_back == "<|tool"


def test_a_reader_carries_a_token_cut_anywhere_to_the_next_delta():
    text = "Hi <|im_end|> <x"
    for cut in range(1, len(text)):
        reader = SpecialTokenReader(KIMI_SPECIAL_TOKENS)
        pieces = reader.feed(text[:cut]) + reader.feed(text[cut:])
        assert [p for p, is_token in pieces if is_token] == ["<|im_end|>"], cut
        assert "".join(p for p, _ in pieces) + reader.finish() == text
        assert reader.finish() == ""
