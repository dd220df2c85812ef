"""Specification of structured outputs in the engine (`engine/structured_output.py`, xgrammar), on the tiny model.

The tiny model's weights are random, so what it would say is noise: under a constraint even noise must come out
as the constraint's language. So:

- a regex, a choice, a JSON schema and any JSON object give output of exactly that language, greedy and sampled,
  and finish "stop" (the constraint complete, its stop token sampled); a schema of bounded values finishes within
  a bounded max_tokens whatever the weights (JSON_MAX_WHITESPACE bounds every gap);
- the mask allows exactly the tokens that continue the constraint (a special token never, a stop token only
  where the constraint is complete), with either tokenizer backend (tokenizer.json, Kimi's tiktoken.model);
- unconstrained requests in the same batches, as constrained ones join and leave, come out byte-identical to a
  run without any constrained request, and rank 1 in their raw logprobs: the mask touches constrained rows only;
  logprobs stay raw (a token the constraint forbids keeps its logprob);
- a constraint that does not compile is a ValueError at submission and costs nothing; without xgrammar a
  constrained request is a ValueError that says so and every other request is served;
- a matcher lives exactly as long as its request (finished, aborted, failed: gone), survives preemption (the
  request's output equals its run without preemption), and compiled grammars are reused (an LRU by constraint);
- a token the constraint rejects (min_tokens banned the only allowed token) fails that request with an error,
  never silently continues, and the engine goes on serving the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sys

import pytest
import torch

from k3serve.engine.llm_engine import LLMEngine
from k3serve.engine.outputs import RequestFailedError
from k3serve.engine.request import RequestStatus
from k3serve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from k3serve.engine.constraint import JSON_MAX_WHITESPACE
from k3serve.engine.stream_types import GenerateRequest
from k3serve.engine.structured_output import GrammarCompiler, StructuredOutputs, TokenMask
from k3serve.model.tokenizer import Tokenizer

from _llm_harness import (
    cache_bytes_for,
    make_async_engine,  # noqa: F401  (fixture)
    make_llm,  # noqa: F401  (fixture)
    random_prompt,
)

REGEX = "[ab]{5}"
SCHEMA = {
    "type": "object",
    "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 999}, "color": {"enum": ["red", "green"]}},
    "required": ["count", "color"],
    "additionalProperties": False,
}


def assert_matches_schema(text: str) -> None:
    """`text` is JSON of SCHEMA: exactly its two keys, an integer in range and one of the enum."""
    value = json.loads(text)
    assert set(value) == {"count", "color"}, text
    assert type(value["count"]) is int and 0 <= value["count"] <= 999 and value["color"] in ("red", "green"), text


# The schema's output is bounded: 8 gaps of at most JSON_MAX_WHITESPACE whitespace characters (a token has at
# least one) plus under 30 tokens of keys, values and punctuation, plus the stop token.
SCHEMA_MAX_TOKENS = 8 * JSON_MAX_WHITESPACE + 30 + 1
ASYNC_TIMEOUT_S = 60.0


def constrained(temperature: float = 0.0, max_tokens: int = 16, seed: int | None = None,
                **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          structured_outputs=StructuredOutputsParams(**constraint))


def prompts(num: int, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [random_prompt(gen, 8 + 9 * i) for i in range(num)]


def sampled_and_greedy(num_sampled: int = 3, **constraint) -> list[SamplingParams]:
    """One greedy request and `num_sampled` seeded ones at temperature 1 under `constraint`."""
    return [constrained(**constraint)] + [constrained(1.0, seed=s, **constraint) for s in range(num_sampled)]


def assert_ends_at_a_stop_token(llm, output) -> None:
    assert output.finish_reason == "stop", output
    assert output.token_ids[-1] in llm.get_tokenizer().stop_token_ids


# ---- the language of each kind of constraint -----------------------------------------------
def test_a_regex_gives_exactly_its_language(make_llm):
    llm = make_llm()
    params = sampled_and_greedy(5, regex=REGEX)
    for out in llm.generate(prompts(len(params)), params):
        assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text
        assert_ends_at_a_stop_token(llm, out.outputs[0])


@pytest.mark.parametrize("choice", [["yes", "no"], ['say "a"', "back\\slash", "é", "two\nlines", "😀"]],
                         ids=["yes_no", "escapes"])
def test_a_choice_gives_one_of_its_strings(make_llm, choice: list[str]):
    llm = make_llm()
    params = sampled_and_greedy(5, choice=choice)
    for out in llm.generate(prompts(len(params)), params):
        assert out.outputs[0].text in choice
        assert_ends_at_a_stop_token(llm, out.outputs[0])


def test_a_json_schema_gives_json_that_validates(make_llm):
    llm = make_llm()
    params = [dataclasses.replace(p, max_tokens=SCHEMA_MAX_TOKENS) for p in sampled_and_greedy(3, json=SCHEMA)]
    for out in llm.generate(prompts(len(params)), params):
        assert_matches_schema(out.outputs[0].text)
        assert_ends_at_a_stop_token(llm, out.outputs[0])


def test_json_object_gives_a_json_object(make_llm):
    """Any object may go on forever; a bias towards "}" lets it close as soon as the grammar allows. Without the
    mask the bias would give "}}}}": the object parses only because the grammar ordered the tokens."""
    llm = make_llm()
    close = llm.get_tokenizer().encode("}")[0]
    params = [dataclasses.replace(p, logit_bias={close: 100.0}) for p in sampled_and_greedy(json_object=True)]
    for out in llm.generate(prompts(len(params)), params):
        assert isinstance(json.loads(out.outputs[0].text), dict), out.outputs[0].text
        assert_ends_at_a_stop_token(llm, out.outputs[0])


def test_a_grammar_gives_a_sentence_of_it(make_llm):
    llm = make_llm()
    params = sampled_and_greedy(grammar='root ::= "(" digit ("," digit){0,3} ")"\ndigit ::= [0-9]')
    for out in llm.generate(prompts(len(params)), params):
        assert re.fullmatch(r"\(\d(,\d){0,3}\)", out.outputs[0].text), out.outputs[0].text
        assert_ends_at_a_stop_token(llm, out.outputs[0])


# ---- the mask ---------------------------------------------------------------------------------
def allowed_token_ids(mask: TokenMask, row: int, vocab_size: int) -> set[int]:
    bits = mask.bitmask[row]
    return {t for t in range(vocab_size) if int(bits[t // 32]) >> (t % 32) & 1}


@pytest.fixture(params=["tokenizer.json", "tiktoken.model"])
def tokenizer(request, tiny_checkpoint, tmp_path) -> Tokenizer:
    """The tiny tokenizer, or the same byte-level vocabulary as a Kimi-style tiktoken.model whose special tokens
    follow the base ranks with gaps (reserved ids) between them."""
    tiny = Tokenizer.from_dir(tiny_checkpoint)
    if request.param == "tokenizer.json":
        return tiny
    pytest.importorskip("tiktoken")
    import base64

    num_base = tiny.vocab_size - len(tiny.special_tokens)
    lines = [f"{base64.b64encode(b).decode()} {i}" for i, b in enumerate(tiny.token_bytes(list(range(num_base))))]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    names = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>"]
    added = {str(num_base + 3 * k): {"content": t, "special": True} for k, t in enumerate(names)}
    config = {"added_tokens_decoder": added,
              "bos_token": "[BOS]", "eos_token": "[EOS]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(tmp_path)


def test_the_mask_allows_exactly_the_tokens_that_continue_the_constraint(tokenizer: Tokenizer):
    vocab_size = tokenizer.vocab_size + 7  # a model vocabulary padded past the tokenizer's
    outputs = StructuredOutputs(tokenizer, vocab_size)
    end_of_turn = tokenizer.special_token_id("<|im_end|>")
    outputs.add("r", SamplingParams(stop_token_ids=[end_of_turn],
                                    structured_outputs=StructuredOutputsParams(regex="[ab]{3}")))
    pieces = tokenizer.token_bytes(list(range(tokenizer.vocab_size)))

    def of_ab(max_len: int) -> set[int]:
        return {t for t, b in enumerate(pieces) if b and set(b) <= set(b"ab") and len(b) <= max_len
                and t not in tokenizer.special_token_ids}

    assert of_ab(3), "the vocabulary has a and b"
    for consumed in range(3):
        assert allowed_token_ids(outputs.token_mask(["r"]), 0, vocab_size) == of_ab(3 - consumed)
        assert not outputs.accept("r", tokenizer.encode("a")[0])
    assert allowed_token_ids(outputs.token_mask(["r"]), 0, vocab_size) == {tokenizer.eos_token_id, end_of_turn}
    assert outputs.accept("r", end_of_turn), "a stop token of the request completes the constraint"


def test_the_mask_sets_minus_inf_where_a_constrained_row_forbids_and_leaves_other_rows_alone(tiny_checkpoint):
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    vocab_size = tokenizer.vocab_size
    outputs = StructuredOutputs(tokenizer, vocab_size)
    outputs.add("regex", constrained(regex=REGEX))
    outputs.add("choice", constrained(choice=["yes", "no"]))
    logits = torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(0))
    mask = outputs.token_mask(["free", "regex", "free2", "choice", "free3"])
    assert mask.rows == [1, 3]
    masked = logits.clone()
    mask.apply(masked)
    for row, request_row in ((1, 0), (3, 1)):
        allowed = sorted(allowed_token_ids(mask, request_row, vocab_size))
        expected = torch.full((vocab_size,), float("-inf"))
        expected[allowed] = logits[row, allowed]
        assert torch.equal(masked[row], expected)
    assert torch.equal(masked[[0, 2, 4]], logits[[0, 2, 4]])
    assert outputs.token_mask(["free", "free2"]) is None  # no constrained row: no mask at all


def test_logprobs_stay_raw_under_a_constraint(make_llm):
    """The top tokens are the model's own, forbidden ones included, at their unmasked logprobs."""
    llm = make_llm()
    out = llm.generate(prompts(1), [SamplingParams(temperature=0.0, max_tokens=8, logprobs=5,
                                                   structured_outputs=StructuredOutputsParams(regex=REGEX))])[0]
    ab = set(llm.get_tokenizer().encode("a") + llm.get_tokenizer().encode("b") + llm.get_tokenizer().encode("ab"))
    forbidden_top = [t for entry in out.outputs[0].logprobs for t, lp in entry.items() if t not in ab and lp.rank == 1]
    assert forbidden_top, "the model's own favourites, which the regex forbids, are reported"
    assert all(lp.logprob > float("-inf") for entry in out.outputs[0].logprobs for lp in entry.values())


# ---- a batch of constrained and unconstrained requests ------------------------------------------
def run_mixed_batch(engine: LLMEngine, with_constrained: bool) -> dict[str, tuple]:
    """Greedy and seeded unconstrained requests join at steps 0 and 4; constrained ones (a regex unseeded at
    temperature 1, a JSON schema greedy, a choice) join at steps 0, 3 and 6 and leave as they complete. Checks
    that every constrained output is of its language; returns each unconstrained request's (tokens, text,
    finish reason, raw-logprob ranks of its greedy tokens)."""
    free = dict(max_tokens=14, ignore_eos=True, logprobs=0)
    joins = {
        0: [("greedy", SamplingParams(temperature=0.0, **free)),
            ("seeded", SamplingParams(temperature=0.9, seed=4, **free))],
        4: [("late", SamplingParams(temperature=0.0, **{**free, "max_tokens": 6}))],
    }
    if with_constrained:
        joins[0].append(("regex", constrained(1.0, regex=REGEX)))
        joins[3] = [("json", constrained(max_tokens=SCHEMA_MAX_TOKENS, json=SCHEMA))]
        joins[6] = [("choice", constrained(choice=["yes", "no"]))]
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    ranks: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    step, num_mixed_steps = 0, 0
    while step <= max(joins) or engine.has_unfinished():
        for request_id, params in joins.get(step, []):
            prompt = random_prompt(torch.Generator().manual_seed(len(request_id)), 10 + 7 * len(request_id))
            engine.add_request(prompt, params, request_id=request_id)
            tokens[request_id] = []
        deltas = engine.step()
        num_mixed_steps += any(d.request_id in engine.structured_outputs for d in deltas) and any(
            d.logprobs is not None for d in deltas)
        for delta in deltas:
            tokens[delta.request_id] += delta.new_token_ids
            texts[delta.request_id] = texts.get(delta.request_id, "") + delta.new_text
            ranks.setdefault(delta.request_id, []).extend(e.ranks[0] for e in delta.logprobs or [])
            if delta.finished:
                finish[delta.request_id] = delta.finish_reason
        step += 1
    if with_constrained:
        assert num_mixed_steps > 3, "constrained and unconstrained requests shared steps"
        assert re.fullmatch(REGEX, texts["regex"]) and texts["choice"] in ("yes", "no")
        assert_matches_schema(texts["json"])
        assert [finish[r] for r in ("regex", "json", "choice")] == ["stop"] * 3
    return {rid: (tokens[rid], texts[rid], finish[rid], ranks[rid]) for rid in ("greedy", "seeded", "late")}


def test_unconstrained_requests_are_untouched_by_constrained_ones_joining_and_leaving(make_llm):
    chunked = dict(max_num_seqs=8, max_num_batched_tokens=32, max_adaptive_batched_tokens=32)
    alone = run_mixed_batch(make_llm(**chunked).engine, with_constrained=False)
    mixed = run_mixed_batch(make_llm(**chunked).engine, with_constrained=True)
    assert mixed == alone
    assert mixed["greedy"][3] == [1] * 14 and mixed["late"][3] == [1] * 6


# ---- submission -------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint, message", [
    (dict(regex="[ab"), r"regex does not compile: Regex parsing error at position 4: Unclosed '\['"),
    (dict(json="{not json"), "json does not compile: Expecting property name"),
    (dict(json={"type": "nonsense"}), 'json does not compile: Unsupported type "nonsense"'),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 2}), "minimum greater than maximum"),
    (dict(grammar="root ::= undefined_rule"), 'grammar does not compile: .*Rule "undefined_rule" is not defined'),
], ids=["regex", "json_text", "json_type", "json_range", "grammar"])
def test_a_constraint_that_does_not_compile_is_a_value_error_at_submission(make_llm, constraint, message):
    engine = make_llm().engine
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
    assert not engine.scheduler.has_unfinished() and engine.structured_outputs.num_matchers == 0


def test_async_engine_answers_a_bad_constraint_with_value_error_and_keeps_serving(make_async_engine):
    engine = make_async_engine()

    async def bad_then_good():
        with pytest.raises(ValueError, match="does not compile"):
            async for _ in engine.generate(GenerateRequest("bad", [1, 2, 3], constrained(regex="(a"))):
                pass
        return [d async for d in engine.generate(GenerateRequest("good", [1, 2, 3], constrained(regex=REGEX)))]

    deltas = asyncio.run(asyncio.wait_for(bad_then_good(), ASYNC_TIMEOUT_S))
    assert re.fullmatch(REGEX, "".join(d.new_text for d in deltas)) and deltas[-1].finish_reason == "stop"


def test_without_xgrammar_a_constrained_request_is_refused_and_the_rest_is_served(make_llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # what `import xgrammar` meets where it is not installed
    llm = make_llm()
    with pytest.raises(ValueError, match=r"structured outputs need the xgrammar package \(xgrammar==0\.2\.8\)"):
        llm.generate([1, 2, 3], constrained(regex=REGEX))
    out = llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_compiled_grammars_are_reused_least_recently_used_first_out(tiny_checkpoint):
    compiler = GrammarCompiler(Tokenizer.from_dir(tiny_checkpoint), 512, cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    assert compiler.compile(a) is compiler.compile(StructuredOutputsParams(regex="a+"))  # keyed by the constraint
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recently used
    compiler.compile(c)  # evicts b
    assert compiler.num_compiled == 3
    compiler.compile(a)
    assert compiler.num_compiled == 3
    compiler.compile(b)
    assert compiler.num_compiled == 4


# ---- a matcher's life -------------------------------------------------------------------------
def test_a_matcher_lives_as_long_as_its_request(make_llm):
    engine = make_llm(max_num_seqs=2).engine
    running = engine.add_request([1, 2, 3], constrained(max_tokens=SCHEMA_MAX_TOKENS, json=SCHEMA))
    aborted = engine.add_request([4, 5, 6], constrained(1.0, max_tokens=SCHEMA_MAX_TOKENS, json_object=True))
    waiting = engine.add_request([7, 8, 9], constrained(regex=REGEX))  # max_num_seqs=2: not admitted yet
    engine.add_request([1, 2], SamplingParams(max_tokens=4))
    assert engine.structured_outputs.num_matchers == 3
    for _ in range(3):
        engine.step()
    assert engine.abort_request(aborted).finish_reason == "abort"
    assert engine.abort_request(waiting).finish_reason == "abort"
    assert engine.structured_outputs.num_matchers == 1
    assert running in engine.structured_outputs
    while engine.has_unfinished():
        engine.step()
    assert engine.structured_outputs.num_matchers == 0


def test_a_preempted_request_keeps_its_matcher_and_its_output(make_llm, tiny_checkpoint):
    """22 MLA blocks for ~2.5k prompt tokens: the constrained request, arriving last, is preempted after sampling
    and recomputed; its seeded output equals its run alone."""
    gen = torch.Generator().manual_seed(7)
    prompt = random_prompt(gen, 300)
    params = constrained(1.0, max_tokens=40, seed=11, regex="[ab ]{30}")
    alone = make_llm().generate(prompt, params)[0].outputs[0]
    assert re.fullmatch("[ab ]{30}", alone.text) and alone.finish_reason == "stop"

    small_cache = cache_bytes_for(tiny_checkpoint, num_blocks=22, num_slots=16)
    engine = make_llm(max_num_seqs=8, max_model_len=1100, cache_memory_bytes=small_cache).engine
    for n in (1, 40, 126, 250, 700, 1020, 62):
        engine.add_request(random_prompt(gen, n), SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    victim = engine.scheduler.requests[engine.add_request(prompt, params)]
    token_ids, preempted_after_sampling = [], False
    while engine.has_unfinished():
        token_ids += [t for d in engine.step() if d.request_id == victim.request_id for t in d.new_token_ids]
        preempted_after_sampling |= victim.status is RequestStatus.PREEMPTED and victim.num_output_tokens > 0
    assert preempted_after_sampling, "the constrained request was not preempted after sampling"
    assert token_ids == alone.token_ids


# ---- a token the constraint rejects -----------------------------------------------------------
def test_a_rejected_token_fails_its_request_and_the_engine_serves_the_rest(make_async_engine):
    """min_tokens bans the stop token while "[ab]{2}" allows nothing else: no allowed token is left to sample, and
    whatever is sampled is rejected. That request fails loudly; the one beside it finishes."""
    engine = make_async_engine()
    stuck = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6,
                           structured_outputs=StructuredOutputsParams(regex="[ab]{2}"))

    async def both():
        async def collect(request_id, prompt, params):
            return [d async for d in engine.generate(GenerateRequest(request_id, prompt, params))]

        return await asyncio.gather(collect("stuck", [1, 2, 3], stuck),
                                    collect("fine", [4, 5, 6], constrained(regex=REGEX)), return_exceptions=True)

    failed, served = asyncio.run(asyncio.wait_for(both(), ASYNC_TIMEOUT_S))
    assert isinstance(failed, RequestFailedError), failed
    assert "is not allowed by its structured output constraint" in str(failed)
    assert re.fullmatch(REGEX, "".join(d.new_text for d in served)) and served[-1].finish_reason == "stop"


def test_offline_generate_raises_for_a_rejected_token(make_llm):
    llm = make_llm()
    stuck = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6,
                           structured_outputs=StructuredOutputsParams(regex="[ab]{2}"))
    with pytest.raises(RequestFailedError, match="token .* is not allowed"):
        llm.generate([[1, 2, 3], [4, 5, 6]], [stuck, SamplingParams(max_tokens=30, ignore_eos=True)])
