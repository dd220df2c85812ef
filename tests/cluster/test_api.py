"""The OpenAI ingress over a real AsyncEngine on the tiny model (random weights: the text is
noise, so tests compare runs with each other, not with expected words)."""

from __future__ import annotations

import asyncio
import json
from typing import Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from k3serve.cluster.api import EngineClient, EngineOverloadedError, build_app
from k3serve.cluster.api.protocol import MAX_CHOICES
from k3serve.cluster.metrics import ITL_BUCKETS, REQUEST_TIME_BUCKETS, TTFT_BUCKETS, IngressMetrics
from k3serve.engine.stream_types import EngineDeadError

from _api_harness import wait_pools_free

pytestmark = pytest.mark.anyio

PROMPT = "Return a new dictionary with the keys"
GREEDY = {"temperature": 0.0}
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def billed(usage: dict) -> dict:
    """A usage without its cached tokens: a second run of a prompt may hit the prefix cache the first one filled."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def parse_sse(body: str) -> list[dict | str]:
    """Every event of an SSE body; each must be a `data: ` line followed by a blank line."""
    assert body.endswith("\n\n"), body[-50:]
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def assert_error(response: httpx.Response, status: int, *, message: str | None = None, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text
    if message is not None:
        assert message in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---- completions --------------------------------------------------------------------------------
async def test_completion_text_and_token_prompts_agree(http, client):
    ids = client.tokenizer.encode(PROMPT)
    results = []
    for prompt in (PROMPT, ids, [PROMPT], [ids]):
        r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, **GREEDY})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["model"] == client.model_name and isinstance(body["created"], int)
        (choice,) = body["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8, "total_tokens": len(ids) + 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
        results.append(choice["text"])
    assert len(set(results)) == 1, results


async def test_completion_stream_include_usage(http):
    payload = {"prompt": PROMPT, "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}, **GREEDY}
    r = await http.post("/v1/completions", json=payload)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = parse_sse(r.text)
    *content, last = chunks
    assert all("usage" not in c and c["object"] == "text_completion" for c in content)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    full = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, **GREEDY})
    assert "".join(c["choices"][0]["text"] for c in content) == full.json()["choices"][0]["text"]


async def test_stop_string_ends_the_text(http):
    base = (await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, **GREEDY})).json()
    text = base["choices"][0]["text"]
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalnum())
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "stop": [stop], **GREEDY})
    choice = r.json()["choices"][0]
    assert choice["text"] == text[: text.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


async def test_seed_reproduces_sampled_text(http):
    payload = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "top_k": 50, "seed": 1234}
    texts = [(await http.post("/v1/completions", json=payload)).json()["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1]


async def test_ignore_eos_generates_exactly_max_tokens(http):
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, **GREEDY})
    body = r.json()
    assert body["usage"]["completion_tokens"] == 40 and body["choices"][0]["finish_reason"] == "length"


async def test_completion_logprobs(http):
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "logprobs": 2, **GREEDY})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == logprob
        assert logprob == max(top.values())  # greedy: the chosen token is the best
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


async def test_completion_echo_of_a_token_prompt(http, client):
    """echo: the prompt's text before the completion; with logprobs, one entry a prompt token (the first null: it
    has no context) then one a generated token; as a list of token ids, the prompt echoes as its decoded text."""
    ids = client.tokenizer.encode(PROMPT)
    r = await http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 0,
                                                 "ignore_eos": True, **GREEDY})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(client.tokenizer.decode(ids, skip_special_tokens=False))
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:]) and all(len(t) == 1 for t in lp["top_logprobs"][1:])
    plain = await http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "ignore_eos": True, **GREEDY})
    assert choice["text"] == client.tokenizer.decode(ids, skip_special_tokens=False) + plain.json()["choices"][0]["text"]


async def test_bare_async_engine_is_an_engine_client(engine):
    if not all(hasattr(engine, name) for name in ("model_name", "max_model_len", "check_health")):
        pytest.skip("this AsyncEngine lacks the EngineClient attributes")
    assert isinstance(engine, EngineClient)
    app = build_app(engine, IngressMetrics(CollectorRegistry(), model_name=engine.model_name))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as h:
        assert (await h.get("/health")).status_code == 200
        r = await h.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ---- chat ---------------------------------------------------------------------------------------
async def test_chat_string_and_text_parts_agree(http, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a dataclass field."}]
    as_parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    num_prompt = len(client.tokenizer.encode_chat(messages))
    texts = []
    for msgs in (messages, as_parts):
        r = await http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "ignore_eos": True, **GREEDY})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        (choice,) = body["choices"]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == num_prompt and body["usage"]["completion_tokens"] == 8
        texts.append(choice["message"]["content"])
    assert texts[0] == texts[1]


async def test_chat_max_completion_tokens_wins(http):
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 7,
               "ignore_eos": True, **GREEDY}
    r = await http.post("/v1/chat/completions", json=payload)
    assert r.json()["usage"]["completion_tokens"] == 7


async def test_chat_stream_in_guidellm_shape(http):
    """What guidellm sends and reads: stream, usage on every chunk and a final usage chunk."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Tell me about queues."}]}]
    payload = {"model": None, "messages": messages, "stream": True, "max_completion_tokens": 12, "ignore_eos": True,
               "stop": None, "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **GREEDY}
    payload.pop("model")
    r = await http.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200, r.text
    chunks = parse_sse(r.text)
    first, *content, last = chunks
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in content)
    counts = [c["usage"]["completion_tokens"] for c in [first, *content]]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 12
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in content)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 12
    full = await http.post("/v1/chat/completions", json={**payload, "stream": False, "stream_options": None})
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert streamed == full.json()["choices"][0]["message"]["content"]


async def test_chat_logprobs(http):
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True,
               "logprobs": True, "top_logprobs": 3, **GREEDY}
    content = (await http.post("/v1/chat/completions", json=payload)).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert entry["logprob"] <= 0 and isinstance(entry["bytes"], list) and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy: chosen is the best
        assert [t["logprob"] for t in entry["top_logprobs"]] == sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)


# ---- models, health, metrics ---------------------------------------------------------------------
async def test_models_and_health(http, client):
    models = (await http.get("/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [client.model_name]
    assert models["data"][0]["max_model_len"] == 512
    assert (await http.get("/health")).status_code == 200
    client.unhealthy = True
    assert_error(await http.get("/health"), 503)


async def test_metrics_after_traffic(http, client):
    await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, **GREEDY})
    await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                                  "ignore_eos": True, "stream": True, **GREEDY})
    await http.post("/v1/completions", json={"prompt": PROMPT, "temperature": -1})
    r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = metric_samples(r.text)
    m = (("model_name", client.model_name),)

    def value(name: str, *labels: tuple[str, str]) -> float:
        return samples[(name, tuple(sorted(m + labels)))]

    v = (("engine", "0"),)  # vLLM's families: the ingress is engine "0"
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_time_per_output_token_seconds"):
        assert value(f"vllm:{name}_count", *v) == 2, name
    assert value("vllm:inter_token_latency_seconds_count", *v) == 4 + 3
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds"):
        assert value(f"vllm:{name}_count", *v) == 0  # reported by the serving layer, not by this app
    assert value("k3serve:handoff_time_seconds_count") == 0
    assert value("vllm:request_success_total", *v, ("finished_reason", "length")) == 2
    assert value("k3serve:request_errors_total", ("status", "400")) == 1
    assert value("vllm:generation_tokens_total", *v) == 9
    assert value("vllm:prompt_tokens_total", *v) > 0
    pool = (("pool", "decode"), ("replica", "0"))
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_block_usage_ratio", "kda_slot_usage_ratio"):
        assert value(f"k3serve:{gauge}", *pool) == 0
    for name, buckets in (("time_to_first_token_seconds", TTFT_BUCKETS), ("inter_token_latency_seconds", ITL_BUCKETS),
                          ("e2e_request_latency_seconds", REQUEST_TIME_BUCKETS)):
        les = [float(dict(k[1])["le"]) for k in samples if k[0] == f"vllm:{name}_bucket"]
        assert les == [*buckets, float("inf")], name


# ---- several choices: n, and a batch of prompts -----------------------------------------------------
OTHER_PROMPT = "Sort the list of numbers in place"
SAMPLED = {"temperature": 1.0, "seed": 4321, "ignore_eos": True}


def by_choice(chunks: list[dict], key: Callable[[dict], str]) -> dict[int, list]:
    """Each choice's pieces (`key` of its stream choice), in stream order, by index."""
    out: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            out.setdefault(choice["index"], []).append(key(choice))
    return out


async def test_n_seeded_choices_are_the_samples_of_seed_plus_j(http, client):
    """vLLM's rule: with a seed, choice j samples with seed + j, so the choices differ and each is what a request of
    one choice with seed + j answers. The prompt is billed once; every choice's tokens are."""
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "n": 3, **SAMPLED})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in body["choices"]]
    assert len(set(texts)) == 3, texts
    for j, text in enumerate(texts):
        one = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, **SAMPLED,
                                                       "seed": SAMPLED["seed"] + j})
        assert one.json()["choices"][0]["text"] == text, j
    num_prompt = len(client.tokenizer.encode(PROMPT))
    assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 18, "total_tokens": num_prompt + 18,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_batch_choices_are_prompt_major_and_echo_their_own_prompt(http, client):
    """Choice i * n + j is the j-th sample of prompt i (vLLM's order); with echo and logprobs, each choice carries its
    own prompt's text and logprobs before its own; usage counts each prompt once."""
    prompts = [client.tokenizer.encode(PROMPT), client.tokenizer.encode(OTHER_PROMPT)]
    payload = {"prompt": prompts, "n": 2, "max_tokens": 3, "echo": True, "logprobs": 1, "ignore_eos": True, **GREEDY}
    r = await http.post("/v1/completions", json=payload)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        alone = (await http.post("/v1/completions", json={**payload, "prompt": prompt, "n": 1})).json()["choices"][0]
        for choice in body["choices"][2 * i : 2 * i + 2]:
            assert choice["text"] == alone["text"]  # greedy: both samples are the greedy text
            assert choice["text"].startswith(client.tokenizer.decode(prompt, skip_special_tokens=False))
            lp, alone_lp = choice["logprobs"], alone["logprobs"]
            assert lp["tokens"] == alone_lp["tokens"] and len(lp["tokens"]) == len(prompt) + 3
            assert lp["token_logprobs"][0] is None  # the first prompt token has no context
            assert lp["token_logprobs"][1:] == pytest.approx(alone_lp["token_logprobs"][1:], abs=1e-4)  # batched
    num_prompt = len(prompts[0]) + len(prompts[1])
    assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 12, "total_tokens": num_prompt + 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_batch_stream_interleaves_choices_each_finishing_once(http):
    payload = {"prompt": [PROMPT, OTHER_PROMPT], "n": 2, "max_tokens": 5, **SAMPLED}
    whole = (await http.post("/v1/completions", json=payload)).json()
    r = await http.post("/v1/completions", json={**payload, "stream": True, "stream_options": {"include_usage": True}})
    *content, last = parse_sse(r.text)
    assert all(len(c["choices"]) == 1 and c["id"] == content[0]["id"] for c in content)
    texts, reasons = by_choice(content, lambda c: c["text"]), by_choice(content, lambda c: c["finish_reason"])
    assert {i: "".join(t) for i, t in texts.items()} == {c["index"]: c["text"] for c in whole["choices"]}
    assert all(r[-1] == "length" and r[:-1] == [None] * (len(r) - 1) for r in reasons.values()), reasons
    assert last["choices"] == [] and billed(last["usage"]) == billed(whole["usage"])


async def test_chat_n_streams_a_role_chunk_per_choice_then_their_content(http, client):
    payload = {"messages": HI, "n": 2, "max_tokens": 4, **SAMPLED}
    whole = (await http.post(CHAT, json=payload)).json()
    contents = [c["message"]["content"] for c in whole["choices"]]
    assert [c["index"] for c in whole["choices"]] == [0, 1] and contents[0] != contents[1]
    num_prompt = len(client.tokenizer.encode_chat(HI))
    assert whole["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 8, "total_tokens": num_prompt + 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    r = await http.post(CHAT, json={**payload, "stream": True, "stream_options": {"include_usage": True}})
    *content, last = parse_sse(r.text)
    roles = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in content[:2]]
    assert roles == [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    streamed = by_choice(content[2:], lambda c: c["delta"].get("content", ""))
    assert ["".join(streamed[0]), "".join(streamed[1])] == contents
    assert last["choices"] == [] and billed(last["usage"]) == billed(whole["usage"])


async def test_metrics_count_a_request_of_several_choices_once(http, client, metrics):
    """One HTTP request is one request in the counters; its tokens are all its choices' (each prompt once); ITL is
    timed within a choice, so 4 choices of 3 tokens give 4 x 2 intervals."""
    await http.post("/v1/completions", json={"prompt": [PROMPT, OTHER_PROMPT], "n": 2, "max_tokens": 3, **SAMPLED})
    name = client.model_name
    assert metrics.success.labels(*metrics.vllm_labels, "length")._value.get() == 1
    assert metrics.generation_tokens.labels(*metrics.vllm_labels)._value.get() == 12
    num_prompt = len(client.tokenizer.encode(PROMPT)) + len(client.tokenizer.encode(OTHER_PROMPT))
    assert metrics.prompt_tokens.labels(*metrics.vllm_labels)._value.get() == num_prompt
    samples = metric_samples(metrics.render().decode())
    count = {n: samples[(f"vllm:{n}_count", (("engine", "0"), ("model_name", name)))] for n in
             ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_prompt_tokens", "request_max_num_generation_tokens")}
    assert count == {"time_to_first_token_seconds": 1, "inter_token_latency_seconds": 8,
                     "request_time_per_output_token_seconds": 1, "e2e_request_latency_seconds": 1,
                     "request_prompt_tokens": 4, "request_max_num_generation_tokens": 1}


@pytest.mark.parametrize("stream", [False, True])
async def test_one_failing_choice_fails_the_request_and_aborts_the_others(http, client, engine, stream):
    """The second prompt has a token outside the vocabulary (the engine refuses it); the first, already running,
    is aborted: nothing keeps generating for a request that has failed."""
    payload = {"prompt": [[1, 2, 3], [1, 2, 10**6]], "max_tokens": 400, "ignore_eos": True, "stream": stream}
    assert_error(await http.post("/v1/completions", json=payload), 400)
    await wait_pools_free(engine, timeout=3.0)  # 400 tokens would take far longer
    assert len(client.aborted) == 2


# ---- errors -------------------------------------------------------------------------------------
BAD_REQUESTS = {  # id: (route, payload, expected param)
    "temperature-type": ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    "temperature-range": ("/v1/completions", {"prompt": PROMPT, "temperature": 5}, "temperature"),
    "top_p-sampling-params": ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    "max_tokens-0": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    "no-prompt": ("/v1/completions", {"max_tokens": 4}, "prompt"),
    "n-0": ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    "n-over-max": (CHAT, {"messages": HI, "n": MAX_CHOICES + 1}, "n"),
    "batch-times-n-over-max": ("/v1/completions", {"prompt": [PROMPT] * (MAX_CHOICES // 2 + 1), "n": 2}, "prompt"),
    "batch-with-an-empty-prompt": ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt"),
    "empty-prompt": ("/v1/completions", {"prompt": []}, "prompt"),
    "logprobs-50": ("/v1/completions", {"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    "stream_options-no-stream": ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}},
                                 "stream_options"),
    "token-outside-vocab": ("/v1/completions", {"prompt": [1, 2, 10**6]}, None),  # the engine's ValueError
    "chat-no-messages": (CHAT, {"messages": []}, "messages"),
    "chat-image-part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                        "messages"),
    "chat-top_logprobs-alone": (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
                                "top_logprobs"),
    "logit_bias-key-abc": ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"abc": 1}}, "logit_bias"),
    "logit_bias-key-negative": ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"-1": 1}}, "logit_bias"),
    "logit_bias-value-200": ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 200}}, "logit_bias"),
    "logit_bias-value-text": (CHAT, {"messages": HI, "logit_bias": {"5": "high"}}, "logit_bias"),
    "logit_bias-outside-vocab": (CHAT, {"messages": HI, "logit_bias": {"5": 1, "100000": 1}}, "logit_bias"),  # engine
    # what k3serve does not implement, asked for
    "tools-on-completions": ("/v1/completions", {"prompt": PROMPT, "tools": [{"type": "function", "function":
                                                                            {"name": "f", "parameters": {}}}]}, "tools"),
    "functions": (CHAT, {"messages": HI, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    "tool_choice-required": (CHAT, {"messages": HI, "tool_choice": "required"}, "tool_choice"),
    "tool_choice-forced": (CHAT, {"messages": HI, "tool_choice": {"type": "function", "function": {"name": "f"}}},
                           "tool_choice"),
    "function_call-forced": (CHAT, {"messages": HI, "function_call": {"name": "f"}}, "function_call"),
    "suffix": ("/v1/completions", {"prompt": PROMPT, "suffix": " and so on."}, "suffix"),
    "best_of-2": ("/v1/completions", {"prompt": PROMPT, "best_of": 2}, "best_of"),
    "chat-echo": (CHAT, {"messages": HI, "echo": True}, "echo"),
}


@pytest.mark.parametrize("route,payload,param", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
async def test_bad_request_is_400(http, route, payload, param):
    assert_error(await http.post(route, json=payload), 400, param=param)


async def test_logit_bias_100_makes_every_greedy_token_that_token(http, client):
    (the,) = client.tokenizer.encode(" the")
    payload = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "logprobs": 0, **GREEDY}
    plain = (await http.post("/v1/completions", json=payload)).json()["choices"][0]
    r = await http.post("/v1/completions", json={**payload, "logit_bias": {str(the): 100}})
    assert r.status_code == 200, r.text
    forced = r.json()["choices"][0]
    assert plain["text"] != " the" * 4 and forced["text"] == " the" * 4
    assert forced["logprobs"]["tokens"] == [" the"] * 4
    assert all(lp < -1 for lp in forced["logprobs"]["token_logprobs"])  # raw: the model's logprobs, not the bias's


async def test_extras_that_ask_for_nothing_are_accepted(http):
    """Refused only when asked for: an empty tool list, tool_choice "none", a text response_format... change
    nothing, and neither do extras such as user or metadata."""
    harmless = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "function_call": "auto",
                "parallel_tool_calls": False, "user": "u", "metadata": {"k": "v"}, "store": False,
                "service_tier": "auto", "echo": False, "best_of": 1, "logit_bias": {}}
    chat = {"messages": HI, "max_tokens": 3, "ignore_eos": True, **GREEDY}
    plain = (await http.post(CHAT, json=chat)).json()
    r = await http.post(CHAT, json={**chat, **harmless})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain["choices"]
    completion = {"prompt": PROMPT, "max_tokens": 3, "suffix": None, "best_of": None, "tool_choice": "auto"}
    assert (await http.post("/v1/completions", json=completion)).status_code == 200


async def test_invalid_json_is_400(http):
    r = await http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400)


@pytest.mark.parametrize("stream", [False, True])
async def test_context_length(http, stream):
    long_prompt = list(range(600))
    error = assert_error(await http.post("/v1/completions", json={"prompt": long_prompt, "stream": stream}), 400)
    assert error["message"].startswith("This model's maximum context length is 512 tokens.")
    r = await http.post("/v1/completions", json={"prompt": list(range(500)), "max_tokens": 20, "stream": stream})
    assert_error(r, 400, message="you requested 520 tokens (500 in the prompt, 20 in the completion)",
                 param="max_tokens")
    chat = {"messages": [{"role": "user", "content": "word " * 700}], "stream": stream}
    assert_error(await http.post("/v1/chat/completions", json=chat), 400, message="maximum context length is 512")


async def test_unknown_model_is_404(http, client):
    assert_error(await http.post("/v1/completions", json={"model": "gpt-4", "prompt": PROMPT}), 404, param="model")
    r = await http.post("/v1/completions", json={"model": client.model_name, "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_overloaded_is_503_and_crash_is_generic_500(http, client, stream):
    client.fail_with = EngineOverloadedError("no decode capacity")
    payload = {"prompt": PROMPT, "max_tokens": 4, "stream": stream}
    assert_error(await http.post("/v1/completions", json=payload), 503)
    client.fail_with = RuntimeError("secret internal detail")
    error = assert_error(await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                         "stream": stream}), 500)
    assert "secret" not in error["message"]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stream", [False, True])
async def test_backend_failing_mid_stream(http, client, engine, metrics, stream, n):
    """After the first delta a stream is already 200: the error comes as an SSE error event. Every choice is
    aborted, and the request counts as one error."""
    client.fail_after_first = EngineDeadError("engine thread died")
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 50, "stream": stream, "n": n})
    if stream:
        assert r.status_code == 200
        *chunks, error = parse_sse(r.text)
        assert error["error"]["code"] == 503 and set(error["error"]) == {"message", "type", "param", "code"}
        assert all("choices" in c for c in chunks)
    else:
        assert_error(r, 503)
    await wait_pools_free(engine)
    assert len(client.aborted) == n
    assert metrics.errors.labels(client.model_name, "503")._value.get() == 1


async def test_unknown_route_is_openai_error(http):
    assert_error(await http.get("/v1/nothing"), 404)


# ---- a real server: streaming over HTTP, and clients that go away ---------------------------------
async def test_uvicorn_streaming_chat(server_url, client):
    async with httpx.AsyncClient(base_url=server_url, timeout=30) as h:
        assert (await h.get("/health")).status_code == 200
        model = (await h.get("/v1/models")).json()["data"][0]["id"]
        payload = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                   "stream": True, "max_completion_tokens": 16, "ignore_eos": True,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        events = []
        async with h.stream("POST", "/v1/chat/completions", json=payload) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line:
                    assert line.startswith("data: ")
                    events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16


CHOICES = {"1-choice": ({"prompt": PROMPT}, 1), "4-choices": ({"prompt": [PROMPT, OTHER_PROMPT], "n": 2}, 4)}


@pytest.mark.parametrize("choices,num_choices", CHOICES.values(), ids=CHOICES.keys())
async def test_disconnect_while_streaming_frees_the_engine(server_url, client, engine, metrics, choices, num_choices):
    payload = {**choices, "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=server_url, timeout=30) as h:
        async with h.stream("POST", "/v1/completions", json=payload) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
    await wait_pools_free(engine, timeout=3.0)  # 400 tokens would take far longer
    assert len(client.aborted) == num_choices
    assert metrics.errors.labels(client.model_name, "499")._value.get() == 1


async def test_stream_never_sent_frees_the_engine(app, client, engine, metrics):
    """The client is gone before the response starts (the ASGI send fails at once, as a server of ASGI spec 2.4
    reports it): Starlette never iterates the stream's body, and the choices are still aborted."""
    body = json.dumps({**CHOICES["4-choices"][0], "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive() -> dict:
        return next(messages, None) or await asyncio.Event().wait()  # then nothing: the client sends no more

    async def send(message: dict) -> None:
        raise OSError("the client is gone")

    with pytest.raises(Exception):
        await app(scope, receive, send)
    await wait_pools_free(engine, timeout=3.0)
    assert len(client.aborted) == 4
    assert metrics.errors.labels(client.model_name, "499")._value.get() == 1


@pytest.mark.parametrize("choices,num_choices", CHOICES.values(), ids=CHOICES.keys())
async def test_disconnect_while_waiting_frees_the_engine(server_url, client, engine, metrics, choices, num_choices):
    payload = {**choices, "max_tokens": 400, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server_url, timeout=0.3) as h:
        with pytest.raises(httpx.ReadTimeout):
            await h.post("/v1/completions", json=payload)
    await wait_pools_free(engine, timeout=3.0)
    assert len(client.aborted) == num_choices
    assert metrics.errors.labels(client.model_name, "499")._value.get() == 1
