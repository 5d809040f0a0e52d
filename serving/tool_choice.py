"""A chat request's tools and ``tool_choice``, as vLLM serves them: ``none`` (the tools go into the prompt, the
output is text), ``auto`` (the model may call them; the server's --tool-call-parser reads the calls out of its
text, with --enable-auto-tool-choice), ``required`` and a named function (the output is forced, by the
structured-output path, to a JSON array of calls or to the function's arguments, valid for the tools' schemas;
serving/tool_parsers/forced.py). What the chat handler needs of them: the tools for the template, the constraint,
and how the output is read back (with the reasoning parser, outside a forced output)."""
from __future__ import annotations

import dataclasses

from jaxpage.sampling_params import SamplingParams
from jaxpage.structured_outputs import StructuredOutputsParams
from serving import openai_protocol as oai
from serving.chat_options import ChatOptions, FieldError
from serving.chat_output import MessageParser
from serving.reasoning import REASONING_PARSERS
from serving.tool_parsers import TOOL_PARSERS, ToolParser
from serving.tool_parsers.forced import NamedCall, RequiredCalls, parameters_schema, required_schema


@dataclasses.dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "function" (a named one)
    tools: list[dict] | None  # what the chat template is given
    parser: ToolParser | None  # what reads the calls out of the output
    constraint: StructuredOutputsParams | None  # required / named: the JSON the output must be
    max_calls: int | None = None  # 1 without parallel tool calls

    @property
    def calls_finish(self) -> bool:
        """Whether a choice that stopped after calling tools finishes with "tool_calls" (a named function's
        forced call finishes "stop", as OpenAI's)."""
        return self.mode in ("auto", "required")

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        changes = {}
        if self.constraint is not None:
            changes["structured_outputs"] = self.constraint
        if self.parser is not None and self.parser.keeps_special_tokens:
            changes["skip_special_tokens"] = False  # the calls' markers are special tokens (Mistral's)
        return dataclasses.replace(params, **changes) if changes else params

    def message_parser(self, reasoning_parser: str | None, prompt: str) -> MessageParser | None:
        """How a choice's text is read (None: it is all content). A forced output has no reasoning."""
        reasoning = None
        if reasoning_parser is not None and self.constraint is None:
            reasoning = REASONING_PARSERS[reasoning_parser](prompt)
        if reasoning is None and self.parser is None:
            return None
        return MessageParser(reasoning, self.parser, self.max_calls)


def plan_tools(body: oai.ChatCompletionRequest, options: ChatOptions) -> ToolPlan:
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan("none", tools or None, None, None)
    named = choice if isinstance(choice, oai.NamedToolChoice) else None
    shown = f"a function named {named.function.name!r}" if named else repr(choice)
    if not tools:
        raise FieldError("tool_choice", f"tool_choice {shown} needs tools")
    max_calls = None if body.parallel_tool_calls else 1
    if choice == "auto":
        if not (options.enable_auto_tool_choice and options.tool_call_parser):
            raise FieldError("tool_choice", "tool_choice 'auto' needs the server started with "
                                            "--enable-auto-tool-choice and --tool-call-parser")
        return ToolPlan("auto", tools, TOOL_PARSERS[options.tool_call_parser](), None, max_calls)
    if body.structured_outputs or (body.response_format or {}).get("type", "text") != "text":
        raise FieldError("tool_choice", f"tool_choice {shown} forces the output's JSON, so it cannot go with "
                                        "response_format or structured_outputs")
    functions = [tool["function"] for tool in tools]
    try:
        if named is None:
            schema, parser = required_schema(functions, body.parallel_tool_calls), RequiredCalls()
        else:
            function = next((f for f in functions if f["name"] == named.function.name), None)
            if function is None:
                raise FieldError("tool_choice", f"tool_choice names {named.function.name!r}, which is not one "
                                                f"of the tools ({', '.join(f['name'] for f in functions)})")
            schema, parser = parameters_schema(function), NamedCall(function["name"])
        constraint = StructuredOutputsParams(json=schema)
    except FieldError:
        raise
    except ValueError as e:
        raise FieldError("tools", f"tools: {str(e).removeprefix('tools: ')}") from None
    return ToolPlan("function" if named else "required", tools, parser, constraint, max_calls)
