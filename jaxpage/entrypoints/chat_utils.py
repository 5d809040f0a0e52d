"""A chat's prompt through a chat template (vLLM's chat_utils): the one place a chat prompt is made, for
``LLM.chat`` and for the server (the chat and Responses APIs, /tokenize, gRPC's messages). Messages as
transformers' ``apply_chat_template`` reads them, the tools where the template reads them, and the template's own
variables (``chat_template_kwargs``, vLLM's: only those the template reads)."""
from __future__ import annotations

import re

import jinja2
import jinja2.meta

from jaxpage.utils import FieldError

# apply_chat_template's own arguments, which chat_template_kwargs may not set
_RESERVED = {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
             "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding", "truncation"}


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


def render_chat(tokenizer, messages: list[dict], template: str | None = None, tools: list[dict] | None = None,
                tools_needed: bool = False, template_kwargs: dict | None = None,
                add_generation_prompt: bool = True) -> str:
    """The messages (transformers' shape: role, content, tool_calls with arguments as objects, tool_call_id) as
    the prompt ``template`` (the server's --chat-template) or the tokenizer's own makes of them. ``tools`` go into
    it if it reads them; if it does not and ``tools_needed``, a FieldError naming tools."""
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
