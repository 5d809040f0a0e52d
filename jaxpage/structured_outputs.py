"""StructuredOutputsParams (vLLM's names): the constraint a request puts on its output, compiled by llguidance.

A constraint is one of ``json`` (a JSON schema, as a dict, a JSON string or a pydantic model class),
``json_object`` (any JSON object), ``regex``, ``choice`` (one of a list of strings) or ``grammar`` (Lark, or
GBNF when it holds ``::=``). It is turned into an llguidance grammar and validated when the params are made, so a
bad schema or regex is a ValueError naming the field; grammars are cached by (kind, spec).
"""
from __future__ import annotations

import dataclasses
import functools
import json as jsonlib

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it (no free whitespace between tokens): what vLLM's guidance backend does with
# disable_any_whitespace, and what keeps a small model from wandering into runs of blanks
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass
class StructuredOutputsParams:
    json: str | dict | type | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):  # a pydantic model
            self.json = self.json.model_json_schema()
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: exactly one of {', '.join(KINDS)} must be given, "
                             f"got {given or 'none'}")
        self.kind = given[0]
        self.spec = _spec(self.kind, getattr(self, self.kind))
        self.grammar_text = compile_grammar(self.kind, self.spec)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.spec


def _spec(kind: str, value) -> str:
    """The constraint as one canonical string (the cache key)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = jsonlib.loads(value)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON schema object, got {type(value).__name__}")
        return jsonlib.dumps(value, sort_keys=True)
    if kind == "json_object":
        return ""
    if kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings")
        return jsonlib.dumps(list(value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"StructuredOutputsParams.{kind} must be a non-empty string")
    return value


@functools.lru_cache(maxsize=256)
def compile_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar for a constraint, validated (ValueError naming the field if it is bad)."""
    try:
        grammar = _grammar(kind, spec)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as e:  # noqa: BLE001 - llguidance raises its own errors for some bad specs
        error = str(e)
    if error:
        raise ValueError(f"StructuredOutputsParams.{kind} is invalid: {error.strip()}")
    return grammar


def _grammar(kind: str, spec: str) -> str:
    M = llguidance.LLMatcher
    if kind == "json":
        return M.grammar_from_json_schema(jsonlib.loads(spec), defaults=JSON_LAYOUT)
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "regex":
        return M.grammar_from_regex(spec)
    if kind == "choice":  # JSON string literals are Lark string literals
        return M.grammar_from_lark("start: " + " | ".join(jsonlib.dumps(c) for c in jsonlib.loads(spec)))
    return M.grammar_from_lark(gbnf_to_lark(spec) if "::=" in spec else spec)
