"""The chat API's tool-call and reasoning parsers (serving/tool_parsers/, serving/reasoning/) on the formats their
models document, each read whole and as a stream (serving/chat_output.py): cut at every point and in random
chunks, the stream's deltas put back together give the message of the whole text, and a tool call's first delta
carries its index, id, type and name, the later ones only fragments of its arguments. The schemas that
``tool_choice: "required"`` and a named function force compile (llguidance) and take what their parsers read.
The Responses API's items of a parse (serving/responses_api.py), streamed at every cut, are the whole output's."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from jaxpage import StructuredOutputsParams
from jaxpage.outputs import CompletionOutput, RequestOutput
from serving import openai_protocol as oai
from serving import responses_protocol as rp
from serving.chat_options import ChatOptions, FieldError
from serving.chat_output import MessageParser, MessageStream
from serving.chat_template import chat_prompt
from serving.reasoning import REASONING_PARSERS
from serving.responses_api import ResponseRendering
from serving.tool_choice import plan_tools
from serving.tool_parsers import TOOL_PARSERS
from serving.tool_parsers.forced import NamedCall, RequiredCalls, required_schema

WEATHER = {"city": "San Francisco", "state": "CA", "unit": "celsius"}

# (parser, the model's output, content, [(name, arguments as JSON)])
CASES = [
    # Hermes 2 Pro / Qwen2.5 (Qwen's function-calling guide: two calls, each in its tags)
    ("hermes", ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, '
                'USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": '
                '"San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>'),
     "", [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
          ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    ("hermes", ('Let me look that up.\n<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n'
                '</tool_call>'), "Let me look that up.\n", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),  # stopped untagged
    ("hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, []),  # cut: content
    # Llama 3.1 JSON tool calling (Meta's prompt format page), with and without <|python_tag|>
    ("llama3_json", ('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                     '"unit": "Fahrenheit"}}'), "",
     [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    ("llama3_json", ('<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}; {"name": "multiply", '
                     '"arguments": {"a": 3, "b": 6}}'), "",
     [("add", {"a": 3, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
    ("llama3_json", "I cannot call a tool for that.", "I cannot call a tool for that.", []),
    ("llama3_json", '{"answer": 42}', None, []),  # JSON, but no call: content
    # Mistral: the v0.3 tokenizer's array, the v11 tokenizer's [TOOL_CALLS]name[ARGS]{...} (vLLM's test outputs)
    ("mistral", ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"city": "San Francisco", "state": '
                 '"CA", "unit": "celsius"}}]'), "", [("get_current_weather", WEATHER)]),
    ("mistral", '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]', "", [("add", {"a": 3, "b": 4})]),
    ("mistral", '[TOOL_CALLS]get_current_weather[ARGS]{"city": "San Francisco", "state": "CA", "unit": "celsius"}',
     "", [("get_current_weather", WEATHER)]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 6}', "",
     [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
    ("mistral", 'hi[TOOL_CALLS]add{"a": 1, "b": 2}', "hi", [("add", {"a": 1, "b": 2})]),
    ("mistral", "No tools needed.", "No tools needed.", []),
    # pythonic (vLLM's tool-calling guide; Llama 3.2)
    ("pythonic", ("[get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', "
                  "metric='celsius')]"), "", [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
                                              ("get_weather", {"city": "Seattle", "metric": "celsius"})]),
    ("pythonic", '[register(name="Ada, \\"the\\" first", tags=["a", "b)"], age=36, admin=True, note=None)]', "",
     [("register", {"name": 'Ada, "the" first', "tags": ["a", "b)"], "age": 36, "admin": True, "note": None})]),
    ("pythonic", "Seattle is rainy today.", "Seattle is rainy today.", []),
    ("pythonic", "[get_weather(city=lookup())]", None, []),  # not a literal: content
]


def _message(parser: MessageParser, text: str) -> tuple[str | None, str, list[tuple[str, str]]]:
    m = parser.parse(text, final=True)
    return m.reasoning, m.content, [(c.name, c.arguments) for c in m.calls]


def _streamed(parser: MessageParser, chunks: list[str]) -> tuple[str | None, str, list[tuple[str, str]]]:
    """The message that a stream of the chunks sends, put back together as a client does."""
    stream = MessageStream(parser)
    reasoning, content, calls = None, "", []
    for i, chunk in enumerate(chunks):
        delta = stream.push(chunk, final=i == len(chunks) - 1)
        if delta.reasoning_content:
            reasoning = (reasoning or "") + delta.reasoning_content
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index == len(calls):  # the first delta of a call: all of its head, once
                assert call.id and call.type == "function" and call.function.name
                calls.append([call.function.name, call.function.arguments or ""])
            else:
                assert call.index < len(calls) and call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments
    return reasoning, content, [tuple(c) for c in calls]


def _chunkings(text: str) -> list[list[str]]:
    """The text whole, one character at a time, cut once at every point, and in random chunks."""
    ways = [[text], list(text) or [""]]
    ways += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(0)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6))) if len(text) > 1 else []
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return ways


@pytest.mark.parametrize("name, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_tool_parsers_read_the_documented_formats_whole_and_streamed(name, text, content, calls):
    parser = MessageParser(None, TOOL_PARSERS[name]())
    reasoning, got_content, got_calls = _message(parser, text)
    assert reasoning is None
    assert got_content == (text if content is None else content)
    assert [(n, json.loads(a)) for n, a in got_calls] == calls
    for chunks in _chunkings(text):
        streamed = _streamed(parser, chunks)
        if content is None:  # malformed: all content in the end (a call already sent cannot be taken back)
            assert streamed[1] == text, chunks
        else:
            assert streamed == (None, got_content, got_calls), chunks


def test_without_parallel_tool_calls_only_the_first_call_is_kept():
    text = CASES[0][1]
    parser = MessageParser(None, TOOL_PARSERS["hermes"](), max_calls=1)
    assert [c[0] for c in _message(parser, text)[2]] == ["get_current_temperature"]
    assert _streamed(parser, list(text)) == _message(parser, text)


REASONING = [
    # DeepSeek-R1: its template opens <think> in the prompt, so the output may only close it
    ("deepseek_r1", "", "<think>\n2 + 2 is 4.\n</think>\n\nThe answer is 4.", "\n2 + 2 is 4.\n",
     "\n\nThe answer is 4."),
    ("deepseek_r1", "", "The user wants a sum.</think>It is 4.", "The user wants a sum.", "It is 4."),
    ("deepseek_r1", "", "Still thinking about", "Still thinking about", ""),  # cut short: all reasoning
    # Qwen3: the model opens the block (up to the 2507 templates) or the prompt does; thinking off, or a model that
    # never thinks: content
    ("qwen3", "<|im_start|>assistant\n", "<think>\nLet me think.\n</think>\n\nHello!", "\nLet me think.\n",
     "\n\nHello!"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm.\n</think>\n\nHi.", "Hmm.\n", "\n\nHi."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello!", None, "Hello!"),
    ("qwen3", "<|im_start|>assistant\n", "Hello! <think> is a tag.", None, "Hello! <think> is a tag."),
]


@pytest.mark.parametrize("name, prompt, text, reasoning, content", REASONING,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(REASONING)])
def test_reasoning_parsers_split_whole_and_streamed(name, prompt, text, reasoning, content):
    parser = MessageParser(REASONING_PARSERS[name](prompt), None)
    assert _message(parser, text) == (reasoning, content, [])
    for chunks in _chunkings(text):
        got = _streamed(parser, chunks)
        assert (got[0] or None, got[1]) == (reasoning or None, content), chunks


def test_reasoning_then_tool_calls():
    text = ('<think>The user wants the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>')
    parser = MessageParser(REASONING_PARSERS["qwen3"](""), TOOL_PARSERS["hermes"]())
    assert _message(parser, text) == ("The user wants the weather.", "\n", [("get_weather", '{"city": "Paris"}')])
    for chunks in _chunkings(text):
        assert _streamed(parser, chunks) == _message(parser, text), chunks


def _items(response) -> list[tuple]:
    """A Response's output items, without their ids."""
    def text(item):
        return "".join(part.text for part in item.content) if item.type != "function_call" else item.arguments
    return [(item.type, getattr(item, "name", None), text(item)) for item in response.output]


def test_a_response_streams_the_items_of_its_whole_output():
    """The Responses API's rendering (serving/responses_api.py) of reasoning, content and two calls, cut at every
    point: the stream's items (each added, its deltas, done, before the next is added; numbered events) are the
    unstreamed response's, each item's deltas put together its text."""
    text = ('<think>Two lookups.</think>Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    body = rp.ResponsesRequest(input="hi", stream=True)

    def rendering():
        return ResponseRendering("resp_1", "m", body, MessageParser(REASONING_PARSERS["qwen3"](""),
                                                                    TOOL_PARSERS["hermes"]()))

    whole = CompletionOutput(0, text, [7] * 9, finish_reason="stop")
    final = rendering().final(RequestOutput("r", None, [1, 2], [whole], True))
    want = [("reasoning", None, "Two lookups."), ("message", None, "Sure.\n"), ("function_call", "get_weather",
            '{"city": "Paris"}'), ("function_call", "get_time", "{}")]
    assert _items(final) == want and final.status == "completed" and final.usage.total_tokens == 11
    for chunks in _chunkings(text):
        render = rendering()
        events = render.start()
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            events += render.push(RequestOutput("r", None, [1, 2], [CompletionOutput(
                0, chunk, [7], finish_reason="stop" if last else None)], last))
        events = [json.loads(e.split("data: ", 1)[1]) for e in events + render.done()]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        completed = rp.Response.model_validate(events[-1]["response"])
        assert events[-1]["type"] == "response.completed" and _items(completed) == want, chunks
        opened, texts = None, {}
        for e in events[2:-1]:
            if e["type"] == "response.output_item.added":
                assert opened is None and e["output_index"] == len(texts), chunks
                opened, texts[e["output_index"]] = e["output_index"], ""
            elif e["type"] == "response.output_item.done":
                assert e["output_index"] == opened, chunks
                opened = None
            elif e["type"].endswith(".delta"):
                assert e["output_index"] == opened, chunks
                texts[opened] += e["delta"]
        assert [texts[i] for i in range(len(want))] == [w[2] for w in want], chunks


FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"$ref": "#/$defs/days"}},
        "required": ["city"], "$defs": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}}},
    {"name": "get_time"},  # no parameters
]


@pytest.mark.parametrize("parallel", [True, False])
def test_the_required_schema_compiles_and_takes_what_its_parser_reads(parallel):
    schema = required_schema(FUNCTIONS, parallel)
    StructuredOutputsParams(json=schema)  # llguidance compiles it
    text = ('[{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}, '
            '{"name": "get_time", "parameters": {}}]')
    if parallel:
        jsonschema.validate(json.loads(text), schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(text), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    parser = MessageParser(None, RequiredCalls())
    assert _message(parser, text) == (None, "", [("get_weather", '{"city": "Rome", "days": 3}'),
                                                 ("get_time", "{}")])
    for chunks in _chunkings(text):
        assert _streamed(parser, chunks) == _message(parser, text)
    cut = text[:-5]  # max_tokens ended the output inside its second call: the first comes back as a call
    assert _message(parser, cut) == (None, "", [("get_weather", '{"city": "Rome", "days": 3}')])
    for chunks in _chunkings(cut):
        assert _streamed(parser, chunks) == _message(parser, cut)
    assert _message(parser, text[:20]) == (None, text[:20], [])  # cut inside the first call: content


def test_two_functions_defining_one_name_differently_are_refused():
    other = {"name": "f", "parameters": {"type": "object", "$defs": {"days": {"type": "string"}}}}
    with pytest.raises(ValueError, match=r"\$defs.days"):
        required_schema([FUNCTIONS[0], other], True)


def test_a_named_function_streams_its_name_first_then_its_arguments():
    parser = MessageParser(None, NamedCall("get_weather"))
    stream = MessageStream(parser)
    first = stream.push('{"city"', final=False)
    assert [(c.index, c.type, c.function.name, c.function.arguments) for c in first.tool_calls] == [
        (0, "function", "get_weather", '{"city"')]
    rest = stream.push(': "Paris"}', final=True)
    assert [(c.index, c.id, c.function.name, c.function.arguments) for c in rest.tool_calls] == [
        (0, None, None, ': "Paris"}')]


class _Tokenizer:
    """As much of a transformers tokenizer as chat_prompt reads before it renders."""
    chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # SmolLM2's, less its system

    def apply_chat_template(self, messages, **kwargs):
        raise AssertionError("not rendered")


def test_a_template_without_tools_is_a_400_naming_tools():
    body = oai.ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}],
                                     tools=[{"type": "function", "function": FUNCTIONS[1]}])
    with pytest.raises(FieldError) as e:
        chat_prompt(_Tokenizer(), body, None, [tool.model_dump() for tool in body.tools], tools_needed=True)
    assert e.value.param == "tools" and "--chat-template" in str(e.value)


def test_auto_tool_choice_needs_the_servers_flags():
    body = oai.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                     tools=[{"type": "function", "function": FUNCTIONS[1]}])
    with pytest.raises(FieldError) as e:
        plan_tools(body, ChatOptions())
    assert e.value.param == "tool_choice" and "--enable-auto-tool-choice" in str(e.value)
    plan = plan_tools(body, ChatOptions(enable_auto_tool_choice=True, tool_call_parser="mistral"))
    assert plan.mode == "auto" and plan.constraint is None and plan.calls_finish
    assert plan_tools(body.model_copy(update={"tool_choice": "none"}), ChatOptions()).parser is None
