"""IncrementalDetokenizer: whole characters only, stop strings across token boundaries, and
streamed deltas that always concatenate to the final text."""

import random

import pytest

from k3serve.engine.detokenizer import IncrementalDetokenizer
from k3serve.engine.sampling_params import SamplingParams

EOS, IM_END = 300, 301


class FakeByteTokenizer:
    """Ids 0..255 are single bytes; a few multi-byte tokens; two special tokens."""

    VOCAB = {
        256: b"Hello",
        257: b" world",
        258: b"\xe4\xb8",  # first two bytes of U+4E2D (CJK) ...
        259: b"\xad!",  # ... its last byte, then "!"
        260: b"###",
        EOS: b"<|eos|>",
        IM_END: b"<|im_end|>",
    }
    all_special_ids = [EOS, IM_END]

    def token_bytes(self, ids):
        return [bytes([i]) if i < 256 else self.VOCAB[i] for i in ids]

    def encode_bytes(self, data: bytes):
        return list(data)


TOK = FakeByteTokenizer()


def stream(ids, **kwargs):
    detok = IncrementalDetokenizer(TOK, **kwargs)
    deltas = []
    for tid in ids:
        deltas.append(detok.push(tid))
        if detok.is_finished:
            break
    deltas.append(detok.finish())
    return detok, deltas


def test_plain_tokens_stream_as_is():
    detok, deltas = stream([256, 257])
    assert deltas == ["Hello", " world", ""]
    assert detok.text == "Hello world" and detok.stopped_by is None


@pytest.mark.parametrize("char", ["😀", "中", "é", "𝄞"])
def test_multibyte_char_split_into_byte_tokens_is_never_partial(char):
    data = f"a{char}b".encode()
    detok, deltas = stream(TOK.encode_bytes(data))
    assert "".join(deltas) == detok.text == f"a{char}b"
    assert "\ufffd" not in "".join(deltas)
    assert deltas[0] == "a"
    assert all(d == "" for d in deltas[1 : len(char.encode())])  # nothing until the last byte
    assert deltas[len(char.encode())] == char


def test_char_split_across_multibyte_tokens():
    detok, deltas = stream([256, 258, 259])
    assert deltas[:3] == ["Hello", "", "中!"]


def test_char_split_across_prompt_and_output():
    # the prompt ends with the first two bytes of U+4E2D; the output finishes it
    detok, deltas = stream([259], prompt_token_ids=[256, 258])
    assert deltas[0] == "中!"


def test_dangling_bytes_at_finish_become_replacement_char():
    detok, deltas = stream([72, 0xF0, 0x9F])
    assert deltas == ["H", "", "", "\ufffd"]


def test_stop_string_across_token_boundary_truncates():
    ids = TOK.encode_bytes(b"The answer is 42.\n\nQ: next")
    detok, deltas = stream(ids, stop=["\n\nQ:"])
    assert detok.stopped_by == "\n\nQ:"
    assert detok.text == "The answer is 42."
    assert "".join(deltas) == detok.text
    assert all("\n" not in d for d in deltas)  # the held-back prefix never leaked


def test_stop_string_spanning_two_multibyte_tokens():
    # "lo wor" spans "Hello" + " world"
    detok, deltas = stream([256, 257, 65], stop=["lo wor"])
    assert detok.stopped_by == "lo wor"
    assert deltas == ["Hel", "", ""] and detok.text == "Hel"  # last: finish()


def test_include_stop_str_in_output():
    detok, deltas = stream([256, 257, 65], stop=["lo wor"], include_stop_str_in_output=True)
    assert detok.text == "Hello wor" == "".join(deltas)


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    detok = IncrementalDetokenizer(TOK, stop=["###"])
    assert detok.push(ord("a")) == "a"
    assert detok.push(ord("#")) == ""
    assert detok.push(ord("#")) == ""
    assert detok.push(ord("b")) == "##b"
    assert detok.push(260) == "" and detok.stopped_by == "###"
    assert detok.text == "a##b"


def test_held_back_prefix_is_flushed_at_finish():
    detok, deltas = stream(TOK.encode_bytes(b"x <"), stop=["<END>"])
    assert deltas == ["x", " ", "", "<"] and detok.text == "x <"


def test_earliest_stop_string_wins():
    detok, _ = stream(TOK.encode_bytes(b"abcd"), stop=["cd", "bcd"])
    assert detok.stopped_by == "bcd" and detok.text == "a"


def test_stop_inside_one_token_cuts_mid_token():
    detok, deltas = stream([256, 257], stop=["wor"])
    assert detok.text == "Hello " == "".join(deltas)


def test_stop_string_with_multibyte_chars():
    ids = TOK.encode_bytes("答案：是。结束".encode())
    detok, deltas = stream(ids, stop=["。结"])
    assert detok.text == "答案：是" == "".join(deltas)


def test_skip_special_tokens():
    detok, deltas = stream([256, IM_END, 257, EOS])
    assert detok.text == "Hello world" and deltas[1] == "" and deltas[3] == ""


def test_keep_special_tokens_when_asked():
    detok, _ = stream([256, IM_END, 257], skip_special_tokens=False)
    assert detok.text == "Hello<|im_end|> world"


def test_special_token_text_can_match_a_stop_string_when_kept():
    detok, _ = stream([256, IM_END, 257], skip_special_tokens=False, stop=["<|im_end|>"])
    assert detok.text == "Hello" and detok.stopped_by == "<|im_end|>"


def test_a_request_keeps_only_the_special_tokens_it_names():
    """The chat API's parsers need their markers in the text; every other special token is skipped token by token,
    so a character split around one (random weights do that) decodes as it does without the markers kept."""
    params = SamplingParams(keep_special_token_ids=[IM_END])
    detok = IncrementalDetokenizer.for_request(TOK, None, params)
    text = "".join(detok.push(t) for t in [258, EOS, 259, IM_END, 257]) + detok.finish()
    assert text == "\u4e2d!<|im_end|> world"
    plain = IncrementalDetokenizer.for_request(TOK, None, SamplingParams())
    assert "".join(plain.push(t) for t in [258, EOS, 259]) + plain.finish() == "\u4e2d!"


def test_push_after_stop_is_an_error():
    detok, _ = stream([256, 257], stop=["wor"])
    with pytest.raises(RuntimeError, match="after the detokenizer finished"):
        detok.push(65)


def test_random_splits_concatenate_to_final_text():
    text = "Streaming 中文 and emoji 😀🎉 with STOP inside ##STOP## and more"
    data = text.encode()
    gen = random.Random(0)
    for _ in range(50):
        cuts = sorted(gen.sample(range(1, len(data)), 12))
        pieces = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]

        class Tok:
            def token_bytes(self, ids):
                return [pieces[i] for i in ids]

        detok = IncrementalDetokenizer(Tok(), stop=["##STOP##"], special_token_ids=[])
        deltas = []
        for i in range(len(pieces)):
            deltas.append(detok.push(i))
            if detok.is_finished:
                break
        deltas.append(detok.finish())
        expected = text[: text.index("##STOP##")]
        assert detok.text == expected == "".join(deltas)
        assert all("#" not in d and "\ufffd" not in d for d in deltas)
