"""vLLM's small routes on the real app: /tokenize (text and chat forms) and /detokenize with vLLM's request and
response shapes, /version, /ping; bad input is OpenAI's error JSON with a 400 or 404."""

from __future__ import annotations

import pytest

import k3serve

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KDA layer?"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]


def assert_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


async def test_tokenize_a_text_prompt_has_vllms_shape(http, client):
    r = await http.post("/tokenize", json={"prompt": "Return a new dictionary", "model": client.model_name})
    assert r.status_code == 200
    ids = client.tokenizer.encode("Return a new dictionary", add_special_tokens=True)
    assert r.json() == {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids, "token_strs": None}


async def test_token_strs_spell_each_token_and_join_to_the_text(http, client):
    body = (await http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})).json()
    assert len(body["token_strs"]) == body["count"] and "".join(body["token_strs"]) == "hello world"


async def test_tokenize_a_chat_counts_what_the_chat_route_prefills(http, client):
    r = await http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == client.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True, tools=TOOLS)
    chat = (await http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 1})).json()
    assert body["count"] == chat["usage"]["prompt_tokens"]
    closed = (await http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})).json()
    assert closed["tokens"] == client.tokenizer.encode_chat(MESSAGES, add_generation_prompt=False)


async def test_detokenize_inverts_tokenize(http, client):
    ids = (await http.post("/tokenize", json={"prompt": "Sort the list in place"})).json()["tokens"]
    r = await http.post("/detokenize", json={"tokens": ids, "model": client.model_name})
    assert r.status_code == 200 and r.json() == {"prompt": client.tokenizer.decode(ids)}
    assert (await http.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"thinking": True}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "x", "model": "another-model"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "another-model"}, 404, "model"),
], ids=["prompt-not-text", "no-prompt", "no-messages", "bad-message", "continue-final", "k2-kwargs",
        "other-model", "id-past-vocab", "negative-id", "tokens-not-a-list", "detok-other-model"])
async def test_bad_input_is_a_clear_error(http, route, body, status, param):
    assert_error(await http.post(route, json=body), status, param)


async def test_a_body_that_is_not_a_json_object_is_a_400(http):
    assert_error(await http.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(await http.post("/detokenize", json=[1, 2]), 400)


async def test_version_and_ping(http, client):
    assert (await http.get("/version")).json() == {"version": k3serve.__version__}
    assert (await http.get("/ping")).status_code == 200 and (await http.post("/ping")).status_code == 200
    client.unhealthy = True
    assert_error(await http.get("/ping"), 503)
