"""Structured outputs on the wire: gRPC's StructuredOutputs message and the OpenAI API's response_format and
vLLM's structured_outputs field become the engine's StructuredOutputsParams; bad ones are rejected naming the
field (the handlers answer a ValueError from sampling_params with INVALID_ARGUMENT, an OpenAIError with its
status)."""
from __future__ import annotations

import json

import pytest

from jaxpage import StructuredOutputsParams
from serving import generation_pb2 as pb
from serving import openai_protocol as oai
from serving.grpc_service import sampling_params as grpc_params
from serving.openai_api import OpenAIError
from serving.openai_api import sampling_params as http_params

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, expected", [
    (dict(json=json.dumps(SCHEMA)), StructuredOutputsParams(json=SCHEMA)),
    (dict(json_object=True), StructuredOutputsParams(json_object=True)),
    (dict(regex=r"\d+"), StructuredOutputsParams(regex=r"\d+")),
    (dict(choice=["yes", "no"]), StructuredOutputsParams(choice=["yes", "no"])),
    (dict(grammar='start: "x"'), StructuredOutputsParams(grammar='start: "x"'))])
def test_grpc_message_gives_the_engine_params(fields, expected):
    params = grpc_params(pb.SamplingParams(structured_outputs=pb.StructuredOutputs(**fields)), "delta")
    assert params.structured_outputs.key == expected.key
    assert grpc_params(pb.SamplingParams(), "delta").structured_outputs is None  # old clients: unconstrained


@pytest.mark.parametrize("fields, field", [(dict(regex="[a"), "regex"), (dict(json="{"), "json"),
                                           (dict(), "exactly one"), (dict(regex="a", choice=["a"]), "exactly one")])
def test_grpc_bad_constraint_is_a_value_error_naming_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        grpc_params(pb.SamplingParams(structured_outputs=pb.StructuredOutputs(**fields)), "delta")


def _chat(**fields) -> oai.ChatCompletionRequest:
    return oai.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize("fields, expected", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
     StructuredOutputsParams(json=SCHEMA)),
    (dict(response_format={"type": "json_object"}), StructuredOutputsParams(json_object=True)),
    (dict(structured_outputs={"choice": ["yes", "no"]}), StructuredOutputsParams(choice=["yes", "no"])),
    (dict(structured_outputs={"regex": "[0-9]+"}, response_format={"type": "json_object"}),
     StructuredOutputsParams(regex="[0-9]+"))])
def test_http_fields_give_the_engine_params(fields, expected):
    body = _chat(**fields)
    assert body.unsupported() is None
    assert http_params(body, 16, None).structured_outputs.key == expected.key
    assert http_params(_chat(response_format={"type": "text"}), 16, None).structured_outputs is None


@pytest.mark.parametrize("fields, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}), "response_format"),
    (dict(response_format={"type": "json_schema"}), "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(structured_outputs={"regex": "(unclosed"}), "structured_outputs"),
    (dict(structured_outputs={"structural_tag": "x"}), "structured_outputs")])
def test_http_bad_constraint_is_a_400_naming_the_field(fields, param):
    with pytest.raises(OpenAIError) as e:
        http_params(_chat(**fields), 16, None)
    assert e.value.status == 400 and e.value.param == param
