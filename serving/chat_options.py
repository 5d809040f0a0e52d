"""The chat endpoint's server options (`jaxpage serve --chat-template --enable-auto-tool-choice
--tool-call-parser --reasoning-parser`, fields of ServerArgs), and the error a chat request's field gets."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jaxpage.utils


FieldError = jaxpage.utils.FieldError  # a bad chat request: a 400 naming ``param``


def read_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM takes it: a file's path, or the template itself (anything with a "{")."""
    if not value or "{" in value:
        return value or None
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--chat-template={value}: no such file (give a Jinja template's path, or the template)")
    return path.read_text()


@dataclasses.dataclass
class ChatOptions:
    chat_template: str | None = None  # the template's text; None: the model's own
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # serving.tool_parsers.TOOL_PARSERS' names
    reasoning_parser: str | None = None  # serving.reasoning.REASONING_PARSERS' names

    @classmethod
    def from_server_args(cls, args) -> ChatOptions:
        return cls(read_chat_template(args.chat_template), args.enable_auto_tool_choice, args.tool_call_parser,
                   args.reasoning_parser)
