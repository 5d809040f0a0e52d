"""A chat request's prompt through a chat template (transformers' ``apply_chat_template``): OpenAI's messages as
templates read them (an assistant's earlier tool calls with their arguments as objects, as transformers' tool
templates expect; a tool message's call id), the tools, and the template's own variables
(``chat_template_kwargs``, vLLM's: only those the template reads)."""
from __future__ import annotations

import json
import re

import jinja2
import jinja2.meta

from serving import openai_protocol as oai
from serving.chat_options import FieldError

# apply_chat_template's own arguments, which chat_template_kwargs may not set
_RESERVED = {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
             "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding", "truncation"}


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


def template_variables(template: str) -> set[str]:
    """The names a Jinja template reads from its context (every identifier in it, if jinja cannot parse it:
    transformers' templates may use tags of their own)."""
    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return set(re.findall(r"[A-Za-z_]\w*", template))
    return jinja2.meta.find_undeclared_variables(parsed)


def chosen_template(template: str | dict | None, with_tools: bool) -> str | None:
    """A tokenizer's templates may be several by name: "tool_use" for a chat with tools, else "default"."""
    if isinstance(template, dict):
        return (with_tools and template.get("tool_use")) or template.get("default")
    return template


def chat_prompt(tokenizer, body: oai.ChatCompletionRequest, template: str | None, tools: list[dict] | None,
                tools_needed: bool) -> str:
    """The prompt of a chat request (see render_chat)."""
    return render_chat(tokenizer, template_messages(body.messages), template, tools, tools_needed,
                       body.chat_template_kwargs)


def render_chat(tokenizer, messages: list[dict], template: str | None, tools: list[dict] | None = None,
                tools_needed: bool = False, template_kwargs: dict | None = None,
                add_generation_prompt: bool = True) -> str:
    """The one place a chat prompt is made (the chat and Responses APIs, /tokenize, gRPC's messages): the
    messages as templates read them through ``template`` (the server's --chat-template) or the tokenizer's own.
    ``tools`` go into it if it reads them; if it does not and ``tools_needed``, a 400 naming tools."""
    template = chosen_template(template or getattr(tokenizer, "chat_template", None), bool(tools))
    if tokenizer is None or not template:
        raise FieldError("messages", "messages: this model has no chat template")
    variables = template_variables(template)
    if tools and "tools" not in variables:
        if tools_needed:
            raise FieldError("tools", "tools: this model's chat template does not support tools (it never reads "
                                      "`tools`); serve it with a --chat-template that does")
        tools = None
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k in variables and k not in _RESERVED}
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise FieldError("messages", f"messages: {e}") from None
