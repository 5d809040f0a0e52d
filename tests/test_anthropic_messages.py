"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens: serving/anthropic_messages.py), end to
end: a real `jaxpage serve` of SmolLM2 (the Hermes tool template, the qwen3 reasoning parser) called with the
official `anthropic` package, as a client would.

- a message (a system prompt, an earlier turn) is the greedy output of the offline engine on the prompt that
  transformers' template makes of the same conversation, with its token counts; the SDK's stream put back together
  is the same message; the SDK's create() without a temperature (the newest sends none) is served;
- a tool_use / tool_result turn goes through the template as transformers renders it; count_tokens is the prompt
  the engine saw;
- tool_choice any and a named tool at temperature 1 over seeds 0-5 with a small max_tokens: every message has a
  tool_use block whose input is valid for the tool's schema (exactly one with disable_parallel_tool_use), streamed
  alike; output_config.format's JSON is valid for its schema;
- a stop sequence ends the message where the unstopped output has it (stop_reason "stop_sequence");
- the reasoning parser's split are thinking blocks, whole and streamed (thinking_delta);
- tool_choice auto: the hermes parser's calls as tool_use blocks; a stream that fails ends with Anthropic's error event;
- bad requests are Anthropic's error object, raised as the SDK's exception types, each naming the field; the
  server keeps serving with every KV block back.
"""
from __future__ import annotations

import asyncio
import json
import re

import anthropic
import httpx
import jsonschema
import pytest

from jaxpage import SamplingParams
from jaxpage.testing.launch import wait_serving
from tests.servers import ENGINE_FLAGS, START_TIMEOUT, TEMPLATE, start_http

MODEL = "smollm2-test"
CHAT_FLAGS = ["--chat-template", str(TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
              "--reasoning-parser", "qwen3"]
GREEDY = {"extra_body": {"temperature": 0}}
TOOLS = [
    {"name": "get_weather", "description": "Current weather in a city", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}},
    {"name": "set_alarm", "description": "Sets an alarm", "input_schema": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                         "label": {"type": "string", "maxLength": 12}},
        "required": ["hour", "label"], "additionalProperties": False}},
]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]
ASK = [{"role": "user", "content": "What is the weather in Paris? And wake me up at 7."}]


@pytest.fixture(scope="module")
def server_started(tmp_path_factory):
    server = start_http(["-m", "serving.cli", "serve", *ENGINE_FLAGS, "--num-kv-blocks", "160",
                         "--served-model-name", MODEL, *CHAT_FLAGS], tmp_path_factory.mktemp("anthropic") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(server_started, smollm2):  # the offline engine loads here while the server warms up
    wait_serving(server_started.target, server_started.proc, START_TIMEOUT, server_started.log)
    return server_started


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def async_client(server) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=120)


def blocks(message) -> list:
    """A message's content without the ids a tool_use block is given."""
    return [{k: v for k, v in block.to_dict().items() if k not in ("id", "parsed_output", "citations")}
            for block in message.content]


async def streamed(server, kw: dict):
    """The SDK's stream of kw: its event types and its final message."""
    async with async_client(server).messages.stream(**kw) as stream:
        types = [event.type async for event in stream]
        return types, await stream.get_final_message()


def as_transformers(history: list[dict], system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + history


def test_a_message_is_the_offline_engines_greedy_output_of_the_same_conversation(server, smollm2):
    """A system prompt and an earlier turn: the text is the offline engine's greedy output on transformers'
    rendering of the conversation, input_tokens its prompt's length, output_tokens its token count; stop_reason
    max_tokens where it was cut, end_turn where it ended; the SDK's stream gives the same message, in Anthropic's
    event order."""
    tokenizer = smollm2.get_tokenizer()
    history = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    flat = [*history[:2], {"role": "user", "content": "Name a colour."}]
    cases = [(None, 40), ("You are terse.", 6)]
    kw = [dict(model=MODEL, messages=history, max_tokens=n, **({"system": system} if system else {}), **GREEDY)
          for system, n in cases]

    async def run():
        c = async_client(server)
        return await asyncio.gather(*(c.messages.create(**k) for k in kw), streamed(server, kw[1]))

    *got, (types, final) = asyncio.run(run())
    for (system, n), message in zip(cases, got):
        prompt = tokenizer.apply_chat_template(as_transformers(flat, system), tokenize=False,
                                               chat_template=TEMPLATE.read_text(), add_generation_prompt=True)
        [want] = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=n))
        w = want.outputs[0]
        assert blocks(message) == [{"type": "text", "text": w.text}]
        assert (message.usage.input_tokens, message.usage.output_tokens) == (len(want.prompt_token_ids),
                                                                             len(w.token_ids))
        assert message.stop_reason == ("max_tokens" if w.finish_reason == "length" else "end_turn")
        assert message.type == "message" and message.role == "assistant" and message.model == MODEL
        assert message.id.startswith("msg_") and message.stop_sequence is None
    assert got[1].stop_reason == "max_tokens"
    assert blocks(final) == blocks(got[1]) and final.usage == got[1].usage and final.stop_reason == "max_tokens"
    assert re.fullmatch("message_start content_block_start (content_block_delta text )+content_block_stop "
                        "message_delta message_stop", " ".join(types)), types
    sampled = client(server).messages.create(model=MODEL, messages=history, max_tokens=8)  # no temperature
    assert sampled.content[0].type == "text" and sampled.usage.output_tokens >= 1


def test_a_tool_result_turn_goes_through_the_template_and_count_tokens_is_the_engines_prompt(server, smollm2):
    """An assistant's tool_use block and the user's tool_result: the prompt is transformers' rendering of the same
    turn (the call's input as arguments, the result a tool message), so the greedy text is the offline engine's;
    count_tokens of the request equals the input_tokens the engine saw."""
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": '{"temperature": 21}'}]}]}]
    flat = [*ASK, {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temperature": 21}'}]
    prompt = smollm2.get_tokenizer().apply_chat_template(flat, tools=OPENAI_TOOLS,
                                                         tokenize=False, chat_template=TEMPLATE.read_text(),
                                                         add_generation_prompt=True)
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt and '"name": "set_alarm"' in prompt
    [want] = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=10))
    c = client(server)
    kw = dict(model=MODEL, messages=history, tools=TOOLS, tool_choice={"type": "none"})
    message = c.messages.create(**kw, max_tokens=10, **GREEDY)
    assert blocks(message) == [{"type": "text", "text": want.outputs[0].text}]
    count = c.messages.count_tokens(**kw)
    assert count.input_tokens == message.usage.input_tokens == len(want.prompt_token_ids)
    assert c.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.").input_tokens == \
        c.messages.create(model=MODEL, messages=ASK, system="Be brief.", max_tokens=1).usage.input_tokens


@pytest.mark.parametrize("tool_choice, parallel", [
    ({"type": "any"}, True), ({"type": "any", "disable_parallel_tool_use": True}, False),
    ({"type": "tool", "name": "set_alarm"}, False)], ids=["any", "any-one", "named"])
def test_forced_tool_use_is_valid_for_the_schema_on_every_seed(server, tool_choice, parallel):
    """tool_choice any (one call with disable_parallel_tool_use) and a named tool, at the default temperature (1)
    with max_tokens 80, seeds 0-5: every message has a tool_use block (the named tool) whose input is valid for its
    schema and nothing else; stop_reason tool_use (max_tokens where the array ran on); the SDK's stream of seed 0
    reassembled is the same message."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80)

    async def run():
        c = async_client(server)
        return await asyncio.gather(*(c.messages.create(**kw, extra_body={"seed": seed}) for seed in range(6)),
                                    streamed(server, {**kw, "extra_body": {"seed": 0}}))

    *messages, (types, final) = asyncio.run(run())
    for m in messages:
        assert m.content and all(block.type == "tool_use" for block in m.content), m
        assert len(m.content) == 1 or parallel
        for block in m.content:
            assert block.id.startswith("toolu_") and (tool_choice["type"] == "any" or block.name == "set_alarm")
            jsonschema.validate(block.input, SCHEMAS[block.name])
        assert m.stop_reason in ("tool_use", "max_tokens"), m
    assert len({json.dumps(blocks(m)) for m in messages}) > 1, "six samples, not copies"
    assert blocks(final) == blocks(messages[0]) and final.stop_reason == messages[0].stop_reason
    assert "input_json" in types


def test_output_config_format_is_json_valid_for_its_schema(server):
    schema = SCHEMAS["get_weather"]
    m = client(server).messages.create(model=MODEL, messages=ASK, max_tokens=60,
                                       extra_body={"output_config": {"format": {"type": "json_schema",
                                                                                "schema": schema}}, "seed": 3})
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_a_stop_sequence_ends_the_message_where_the_output_has_it(server):
    """The greedy output without stop sequences, then with one of its later words as a stop sequence: the text
    is the output before that word, stop_reason stop_sequence naming it; streamed alike."""
    c = client(server)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story about a cat."}], max_tokens=40,
              **GREEDY)
    text = c.messages.create(**kw).content[0].text
    word = text.split()[4]
    stopped = c.messages.create(**kw, stop_sequences=["NEVER", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert blocks(stopped) == [{"type": "text", "text": text[:text.index(word)]}]
    types, final = asyncio.run(streamed(server, {**kw, "stop_sequences": ["NEVER", word]}))
    assert blocks(final) == blocks(stopped) and (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)


def test_thinking_is_the_reasoning_parsers_split_whole_and_streamed(server, smollm2):
    """--reasoning-parser qwen3 on an output that thinks (forced by vLLM's structured_outputs regex): the text in
    <think>...</think> is a thinking block, the rest a text block, in the message and in the stream's
    thinking_delta / text_delta events."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Think, then say hello."}], max_tokens=80,
              thinking={"type": "enabled", "budget_tokens": 1024},
              extra_body={"temperature": 0, "structured_outputs": {"regex": "<think>[a-z ]{3,20}</think>[A-Za-z ]{3,20}"}})
    message = client(server).messages.create(**kw)
    thinking, text = message.content
    assert (thinking.type, text.type) == ("thinking", "text") and thinking.signature == ""
    assert 3 <= len(thinking.thinking) <= 20 and 3 <= len(text.text) <= 20
    assert message.stop_reason == "end_turn"
    types, final = asyncio.run(streamed(server, kw))
    assert blocks(final) == blocks(message) and "thinking" in types and "text" in types


def _post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(server.base + path, json=body, headers=headers, timeout=60)


BAD = [  # (body, the field the message names)
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search",
                                                   "input_schema": {}}]}, "tools.0.type"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"name": "bad name!", "input_schema": {}}]}, "tools.0.name"),
    ({"max_tokens": 5, "messages": ASK, "temperature": -1}, "temperature"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": [""]}, "stop_sequences"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bad_requests_are_anthropic_errors_naming_the_field(server, stream):
    """Each bad request is a 400 in Anthropic's error object whose message names the field; an unknown model is
    the SDK's NotFoundError, a malformed body its BadRequestError, an unknown path under /v1/messages a 404 in
    the same shape; the server keeps serving with every block back."""
    for body, field in BAD:
        r = _post(server, "/v1/messages", {"model": MODEL, **body, "stream": stream})
        error = r.json()
        assert r.status_code == 400 and error["type"] == "error", (body, r.text)
        assert error["error"]["type"] == "invalid_request_error" and field in error["error"]["message"], (body, r.text)
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-nope", messages=ASK, max_tokens=5)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [{"type": "document"}]}])
    assert "messages.0.content.0.type" in e.value.body["error"]["message"]
    r = _post(server, "/v1/messages/nope", {})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.base + "/v1/messages", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert c.messages.create(model=MODEL, messages=ASK, max_tokens=3).usage.output_tokens >= 1
    assert server.all_blocks_free() and server.metrics()["jaxpage:num_requests_in_flight"] == 0


FIXED = ('Ok.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7, "label": "up"}}\n</tool_call>')


def test_auto_tool_choice_reads_the_hermes_calls_as_tool_use_blocks(server):
    """The model's output fixed (vLLM's structured_outputs choice of one string): with tool_choice auto the
    hermes parser's split is a text block and two tool_use blocks with the calls' input, stop_reason tool_use,
    streamed alike; disable_parallel_tool_use keeps the first call; tool_choice none leaves it all text."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80,
              extra_body={"temperature": 0, "structured_outputs": {"choice": [FIXED]}})
    c = client(server)
    message = c.messages.create(**kw)
    want = [{"type": "text", "text": "Ok.\n"}, {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "name": "set_alarm", "input": {"hour": 7, "label": "up"}}]
    assert blocks(message) == want and message.stop_reason == "tool_use"
    assert len({b.id for b in message.content[1:]}) == 2
    types, final = asyncio.run(streamed(server, kw))
    assert blocks(final) == want and final.stop_reason == "tool_use"
    one = c.messages.create(**kw, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert blocks(one) == want[:2]
    none = c.messages.create(**kw, tool_choice={"type": "none"})
    assert blocks(none) == [{"type": "text", "text": FIXED}] and none.stop_reason == "end_turn"


def test_a_stream_that_fails_ends_with_anthropics_error_event():
    """An engine failure under a streamed message (OpenAIServing._message_events, no server): the events so far,
    then Anthropic's error event, counted as the other endpoints' errors."""
    from jaxpage.outputs import CompletionOutput, RequestOutput
    from serving.anthropic_messages import MessageRendering
    from serving.openai_api import OpenAIError, OpenAIServing

    class Lifecycle:
        codes: list = []

        def count_error(self, code):
            self.codes.append(code)

    async def outputs():
        yield 0, RequestOutput("r", None, [1, 2], [CompletionOutput(0, "Hel", [5])], False)
        raise OpenAIError(500, "the engine failed: boom", "messages", "engine_error")

    async def events():
        render = MessageRendering("msg_1", "m", None)
        return [e async for e in OpenAIServing(Lifecycle())._message_events(outputs(), render)]

    got = asyncio.run(events())
    kinds = [e.split("\n", 1)[0].removeprefix("event: ") for e in got]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    start = json.loads(got[0].split("data: ", 1)[1])
    assert start["message"]["usage"]["input_tokens"] == 2 and start["message"]["content"] == []
    assert json.loads(got[-1].split("data: ", 1)[1]) == {
        "type": "error", "error": {"type": "api_error", "message": "the engine failed: boom"}}
    assert Lifecycle.codes == ["INTERNAL"]
