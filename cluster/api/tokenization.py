"""vLLM's tokenizer routes, with its request and response shapes (vllm/entrypoints/serve/tokenize/protocol.py):

    POST /tokenize     {"prompt": str, "add_special_tokens": true} or
                       {"messages": [...], "add_generation_prompt": true, "tools", "chat_template_kwargs"}
                       -> {"count", "max_model_len", "tokens", "token_strs"}   (token_strs with return_token_strs)
    POST /detokenize   {"tokens": [int, ...]} -> {"prompt": str}

A chat's tokens are exactly the prompt /v1/chat/completions would run (the same template and keywords,
template_kwargs.py), tools included whatever a tool_choice would do. A token string is the token's UTF-8, or
"bytes:\\xe4..." for a piece of a character (as logprobs name tokens). Like vLLM these routes sit outside /v1 (no
API key), and `model`, when given, must be the served one (404). Bad input is a 400: a body that is neither form, a
token id outside the vocabulary, vLLM fields k3serve does not serve (continue_final_message, add_special_tokens on
a chat: Kimi's templates write every special token themselves).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError

from .engine_client import EngineClient
from .errors import bad_request
from .formatting import token_text
from .protocol import ChatCompletionRequest, ChatMessage, ChatTool, _Request
from .serving import _check_model
from .template_kwargs import template_kwargs


class _Body(_Request):  # unknown fields are ignored (logged), as vLLM's
    model: str | None = None


class TokenizeCompletionRequest(_Body):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenization_routes(client: EngineClient) -> APIRouter:
    router = APIRouter()
    tokenizer = client.tokenizer

    @router.post("/tokenize")
    async def tokenize(raw: Request) -> TokenizeResponse:
        data = await _json_object(raw)
        body = _validate(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
        _check_model(body.model, client)
        ids = _chat_ids(body, client) if isinstance(body, TokenizeChatRequest) else tokenizer.encode(
            body.prompt, add_special_tokens=body.add_special_tokens)
        strs = [token_text(b) for b in tokenizer.convert_ids_to_bytes(ids)] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=client.max_model_len, tokens=ids, token_strs=strs)

    @router.post("/detokenize")
    async def detokenize(raw: Request) -> DetokenizeResponse:
        body = _validate(DetokenizeRequest, await _json_object(raw))
        _check_model(body.model, client)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (0 to {tokenizer.vocab_size - 1})",
                              "tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    return router


def _chat_ids(body: TokenizeChatRequest, client: EngineClient) -> list[int]:
    if body.continue_final_message:
        raise bad_request("continue_final_message is not served: the prompt ends with the assistant's turn opened "
                          "(add_generation_prompt) or the last message closed", "continue_final_message")
    if body.add_special_tokens:
        raise bad_request("add_special_tokens adds nothing to a chat: its template writes every special token",
                          "add_special_tokens")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    chat = ChatCompletionRequest(messages=body.messages, tools=body.tools, chat_template_kwargs=body.chat_template_kwargs)
    kwargs = template_kwargs(chat, client.tokenizer, constrained=False)
    try:
        return client.tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt, tools=tools,
                                            **kwargs)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None


async def _json_object(raw: Request) -> dict[str, Any]:
    try:
        data = await raw.json()
    except ValueError:
        raise bad_request("the body must be JSON") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    return data


def _validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
