"""Structured outputs from the wire: the gRPC StructuredOutputs message, and the OpenAI API's ``response_format``
(``json_schema``, ``json_object``) and vLLM's ``structured_outputs`` extra field. Each gives the engine's
StructuredOutputsParams (None when unconstrained); a bad constraint is a ValueError naming its field."""
from __future__ import annotations

from typing import Any

from jaxpage.structured_outputs import StructuredOutputsParams


def from_proto(msg) -> StructuredOutputsParams:
    """From a serving.generation_pb2.StructuredOutputs (empty strings and lists mean unset)."""
    fields = {"json": msg.json or None, "json_object": msg.json_object or None, "regex": msg.regex or None,
              "choice": list(msg.choice) or None, "grammar": msg.grammar or None}
    return StructuredOutputsParams(**fields)


def from_openai(response_format: dict[str, Any] | None,
                structured_outputs: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """vLLM's precedence: the structured_outputs field, else response_format; type "text" is unconstrained."""
    if structured_outputs:
        known = {"json", "json_object", "regex", "choice", "grammar"}
        unknown = sorted(set(structured_outputs) - known)
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]} is not supported (use one of {sorted(known)})")
        return StructuredOutputsParams(**structured_outputs)
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format.type={kind!r} must be 'text', 'json_object' or 'json_schema'")
