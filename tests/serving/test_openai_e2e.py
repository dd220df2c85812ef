"""The OpenAI API end to end, with the `openai` client, against real `k3serve serve` processes.

Spec:
- chat and completions, streaming and not, answer in OpenAI's shapes; usage counts are exact:
  prompt_tokens is the tokenizer's count of the (chat-templated) prompt, completion_tokens is
  the number of tokens the client received, and streaming and non-streaming give the same text.
  Each of these holds for the disaggregated server (Ray, Mooncake, 1P1D) and for the colocated
  one (the oracle).
- 16 concurrent greedy requests (different prompts, ignore_eos, 16 tokens) give token for token
  the colocated output on every disaggregated layout: Mooncake 1P1D, NIXL 1P1D, Mooncake 1P2D.
  Text is compared (greedy decoding is deterministic; the server has no token-id output).
- Two decode replicas share a burst of requests.
- A chat with `tools` declares them in the prompt and is served.
- `logit_bias` applies to every generated token, the first (sampled on the prefill engine) included.
- `echo` puts the prompt before the completion; with logprobs, the prompt tokens' logprobs too (the first null),
  the same on both servers (the disaggregated one scores the prompt on its prefill engine), streamed or not.
- A batch of prompts with `n` > 1 answers every (prompt, sample) as a choice, prompt-major; seeded, sample j is the
  sample of seed + j, so a prompt's choices differ and the same request gives the same choices again. Each choice
  is an ordinary engine request: the disaggregated router serves them as any other.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
openai = pytest.importorskip("openai")  # a test extra; the GPU machine has none

from k3serve.model.tokenizer import Tokenizer

from _server_harness import Server, ServerSpec, serve

MAX_TOKENS = 16
NUM_CONCURRENT = 16
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi").split()
PROMPTS = [f"Request {i}: a short note about {w} and the {WORDS[-1 - i]} of it." for i, w in enumerate(WORDS)]
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Which day of the week comes after Tuesday?"}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

LAYOUTS = [ServerSpec(), ServerSpec(transfer="nixl"), ServerSpec(decode_replicas=2), ServerSpec(prefill_tp=2)]


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


def billed(usage) -> dict:
    """A usage without its cached tokens: a prompt run again may hit the prefix cache the earlier run filled."""
    return usage.model_dump(exclude={"prompt_tokens_details"})


@pytest.fixture(params=["disagg_server", "colocated_server"], ids=["disaggregated", "colocated"])
def any_server(request: pytest.FixtureRequest) -> Server:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def api(disagg_server: Server):
    with client_of(disagg_server) as client:
        yield client


def complete_all(server: Server, prompts: list[str]) -> list[openai.types.Completion]:
    """Every prompt at once, one thread per request."""
    with client_of(server) as client, ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.completions.create(
            model=server.model, prompt=p, max_tokens=MAX_TOKENS, **GREEDY), prompts))


@pytest.fixture(scope="session")
def colocated_texts(colocated_server: Server) -> list[str]:
    out = complete_all(colocated_server, PROMPTS)
    assert [c.usage.completion_tokens for c in out] == [MAX_TOKENS] * len(PROMPTS)
    return [c.choices[0].text for c in out]


# ---- API shape and usage ------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_models_lists_the_served_model(any_server: Server) -> None:
    with client_of(any_server) as client:
        assert [m.id for m in client.models.list().data] == ["k3-tiny"]


@pytest.mark.timeout(300)
def test_chat_usage_counts_the_templated_prompt(any_server: Server, tokenizer: Tokenizer) -> None:
    with client_of(any_server) as client:
        out = client.chat.completions.create(model=any_server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, **GREEDY)
    assert out.object == "chat.completion" and out.model == "k3-tiny"
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert out.usage.completion_tokens == MAX_TOKENS
    assert out.usage.total_tokens == out.usage.prompt_tokens + MAX_TOKENS


@pytest.mark.timeout(300)
def test_chat_stream_equals_non_stream(any_server: Server, tokenizer: Tokenizer) -> None:
    with client_of(any_server) as client:
        whole = client.chat.completions.create(model=any_server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, **GREEDY)
        chunks = list(client.chat.completions.create(
            model=any_server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and billed(chunks[-1].usage) == billed(whole.usage)  # the usage chunk, last
    assert all(c.usage is None for c in chunks[:-1])
    assert whole.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))


@pytest.mark.timeout(300)
def test_echo_puts_the_prompt_and_its_logprobs_first(disagg_server: Server, colocated_server: Server,
                                                     tokenizer: Tokenizer) -> None:
    prompt, max_tokens = PROMPTS[2], 4
    num_prompt = len(tokenizer.encode(prompt))
    scored = {}
    for name, server in (("disaggregated", disagg_server), ("colocated", colocated_server)):
        with client_of(server) as client:
            out = client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens, echo=True,
                                            logprobs=2, **GREEDY)
            plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens, echo=True,
                                              **GREEDY)
            chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                                    echo=True, logprobs=2, stream=True, **GREEDY))
        choice, lp = out.choices[0], out.choices[0].logprobs
        assert choice.text.startswith(prompt) and plain.choices[0].text == choice.text, name
        assert out.usage.prompt_tokens == num_prompt and out.usage.completion_tokens == max_tokens, name
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num_prompt + max_tokens, name
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, name
        assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) in (2, 3) for t in lp.top_logprobs[1:]), name
        assert "".join(lp.tokens) == choice.text and lp.text_offset == sorted(lp.text_offset), name
        assert chunks[0].choices[0].text.startswith(prompt), name
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text, name
        streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
        assert streamed == lp.token_logprobs, name
        scored[name] = lp.token_logprobs
    assert scored["disaggregated"][1:] == pytest.approx(scored["colocated"][1:], abs=1e-4)


@pytest.mark.timeout(300)
def test_chat_with_tools_declares_them_in_the_prompt(any_server: Server, tokenizer: Tokenizer) -> None:
    """A request with `tools` is served: the prompt is the templated one with the tools declared, and the text (the
    random model writes no call) is the same streamed or not, with no special token in it."""
    request = dict(model=any_server.model, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, **GREEDY)
    with client_of(any_server) as client:
        whole = client.chat.completions.create(**request)
        chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert whole.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES, tools=TOOLS))
    assert whole.usage.prompt_tokens > len(tokenizer.encode_chat(MESSAGES))
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == MAX_TOKENS
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content and "<|" not in content
    assert billed(chunks[-1].usage) == billed(whole.usage)


@pytest.mark.timeout(300)
def test_completion_stream_equals_non_stream(any_server: Server, tokenizer: Tokenizer) -> None:
    prompt = PROMPTS[0]
    with client_of(any_server) as client:
        whole = client.completions.create(model=any_server.model, prompt=prompt, max_tokens=MAX_TOKENS, **GREEDY)
        chunks = list(client.completions.create(
            model=any_server.model, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == MAX_TOKENS
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and billed(chunks[-1].usage) == billed(whole.usage)
    progress = [c.usage.completion_tokens for c in content]  # continuous usage: never decreasing, ends at the total
    assert progress == sorted(progress) and progress[-1] == MAX_TOKENS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streamed_tokens_equal_completion_tokens(any_server: Server, route: str) -> None:
    """One logprobs entry per generated token reaches the client (the first one sampled by the
    prefill engine included): their number is the usage."""
    with client_of(any_server) as client:
        if route == "chat":
            chunks = list(client.chat.completions.create(
                model=any_server.model, messages=MESSAGES, max_tokens=MAX_TOKENS, logprobs=True, stream=True,
                stream_options={"include_usage": True}, **GREEDY))
            streamed = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
        else:
            chunks = list(client.completions.create(
                model=any_server.model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, logprobs=0, stream=True,
                stream_options={"include_usage": True}, **GREEDY))
            streamed = sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs)
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert streamed == MAX_TOKENS


@pytest.mark.timeout(300)
def test_logit_bias_forces_every_token_the_first_included(any_server: Server, tokenizer: Tokenizer) -> None:
    """A +100 bias on one token makes every greedy token that token: the first, which the disaggregated server's
    prefill engine samples, and the rest, from its decode engine. A token id outside the vocabulary is a 400."""
    (the,) = tokenizer.encode(" the")
    with client_of(any_server) as client:
        out = client.completions.create(model=any_server.model, prompt=PROMPTS[3], max_tokens=4, logprobs=0,
                                        logit_bias={str(the): 100}, **GREEDY)
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=any_server.model, prompt=PROMPTS[3], max_tokens=4,
                                      logit_bias={str(10**6): 1}, **GREEDY)
    assert out.choices[0].logprobs.tokens == [" the"] * 4 and out.choices[0].text == " the" * 4
    assert refused.value.param == "logit_bias" and "Traceback" not in refused.value.message


@pytest.mark.timeout(300)
def test_batch_of_prompts_with_n_seeded_choices(any_server: Server, tokenizer: Tokenizer) -> None:
    prompts = PROMPTS[4:6]
    request = dict(model=any_server.model, prompt=prompts, n=2, seed=11, temperature=1.0, max_tokens=4,
                   extra_body={"ignore_eos": True})
    with client_of(any_server) as client:
        out = client.completions.create(**request)
        again = client.completions.create(**request)
        alone = client.completions.create(**{**request, "prompt": prompts[1], "n": 1, "seed": 12})
    texts = [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert texts[0] != texts[1] and texts[2] != texts[3], texts  # seeds 11 and 12 sample differently
    assert [c.text for c in again.choices] == texts
    assert alone.choices[0].text == texts[3]  # choice 3: prompt 1's sample 1, seed 11 + 1
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)  # each prompt once
    assert out.usage.completion_tokens == 4 * 4


# ---- disaggregated == colocated ----------------------------------------------------------------
@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda s: s.id)
def layout_server(request: pytest.FixtureRequest, tiny_checkpoint: Path, artifacts_dir: Path):
    """The session's Mooncake 1P1D server, or a fresh server of another layout."""
    spec: ServerSpec = request.param
    if spec == ServerSpec():
        yield request.getfixturevalue("disagg_server")
        return
    yield from serve(spec, tiny_checkpoint, artifacts_dir, "e2e")


@pytest.mark.timeout(300)
def test_concurrent_greedy_equals_colocated(layout_server: Server, colocated_texts: list[str]) -> None:
    out = complete_all(layout_server, PROMPTS)
    assert [c.usage.completion_tokens for c in out] == [MAX_TOKENS] * NUM_CONCURRENT
    texts = [c.choices[0].text for c in out]
    mismatched = [i for i, (a, b) in enumerate(zip(texts, colocated_texts)) if a != b]
    assert not mismatched, f"{layout_server.spec.id} differs from colocated on prompts {mismatched}: " \
                           f"{texts[mismatched[0]]!r} != {colocated_texts[mismatched[0]]!r}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout_server", [s for s in LAYOUTS if s.decode_replicas > 1], indirect=True,
                         ids=lambda s: s.id)
def test_two_decode_replicas_share_a_burst(layout_server: Server) -> None:
    """The router spreads concurrent admissions (its stats are refreshed every 0.25 s only)."""
    busiest: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for labels, value in layout_server.gauge("k3serve:num_requests_running", pool="decode").items():
                replica = dict(labels)["replica"]
                busiest[replica] = max(busiest.get(replica, 0.0), value)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with client_of(layout_server) as client, ThreadPoolExecutor(NUM_CONCURRENT) as pool:
            list(pool.map(lambda p: client.completions.create(
                model=layout_server.model, prompt=p, max_tokens=96, **GREEDY), PROMPTS))
    finally:
        done.set()
        watcher.join()
    assert sorted(busiest) == ["decode-0", "decode-1"]
    assert min(busiest.values()) >= NUM_CONCURRENT // 4, f"one replica took (nearly) the whole burst: {busiest}"
