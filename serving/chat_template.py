"""A chat request's prompt through a chat template (transformers' ``apply_chat_template``): OpenAI's messages as
templates read them (an assistant's earlier tool calls with their arguments as objects, as transformers' tool
templates expect; a tool message's call id), the tools, and the template's own variables
(``chat_template_kwargs``, vLLM's: only those the template reads), rendered by jaxpage's
chat_utils.render_chat."""
from __future__ import annotations

import json

from jaxpage.entrypoints.chat_utils import render_chat
from serving import openai_protocol as oai
from serving.chat_options import FieldError

__all__ = ["chat_prompt", "chat_texts", "render_chat", "template_messages"]


def chat_texts(messages: list[oai.ChatMessage]) -> list[str]:
    """What --max-prompt-bytes counts of a chat."""
    return [text for m in messages
            for text in (m.role, m.text(), *(c.function.arguments for c in m.tool_calls or []))]


def template_messages(messages: list[oai.ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        message = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments, i, j)}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _arguments(text: str, i: int, j: int) -> object:
    try:
        return json.loads(text)
    except ValueError as e:
        raise FieldError(f"messages.{i}.tool_calls.{j}.function.arguments", f"messages.{i}.tool_calls.{j}.function."
                                                                           f"arguments is not JSON: {e}") from None


def chat_prompt(tokenizer, body: oai.ChatCompletionRequest, template: str | None, tools: list[dict] | None,
                tools_needed: bool) -> str:
    """The prompt of a chat request (see render_chat)."""
    return render_chat(tokenizer, template_messages(body.messages), template, tools, tools_needed,
                       body.chat_template_kwargs)
