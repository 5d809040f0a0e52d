"""The HTTP API's OpenAPI document (GET /openapi.json) as the responses really are.

FastAPI documents what a route's signature says: the endpoints that stream return a plain Response, so their
success had no schema, and every route with a body listed a 422 that never comes (a request FastAPI cannot
validate is a 400, as every error, in OpenAI's error object). Here the document gives each streaming endpoint its
JSON success and its event stream, health its 200 and 503 without a body, /metrics Prometheus' text, the LoRA
endpoints vLLM's line of text, and every operation OpenAI's error object (Anthropic's on the Messages API's paths)
as its default response (400, 401, 404, 405, 413, 429, 500, 503).
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from serving import anthropic_protocol as ap
from serving import openai_protocol as oai
from serving import pooling_protocol as pp
from serving import responses_protocol as rp
from serving.anthropic_messages import is_messages_path

REF = "#/components/schemas/{model}"
# the success of the endpoints whose handlers return a Response (JSON, or server-sent events with ``stream``)
STREAMED = {"/v1/completions": oai.CompletionResponse, "/v1/chat/completions": oai.ChatCompletionResponse,
            "/v1/responses": rp.Response, "/v1/messages": ap.AnthropicMessagesResponse}
# one server-sent event, as OpenAPI 3.2 reads a stream's items (and tools read a 3.1 stream's schema)
# the success of the endpoints whose handlers return a JSONResponse
JSON = {"/v1/embeddings": pp.EmbeddingResponse, "/pooling": pp.PoolingResponse, "/score": pp.ScoreResponse,
        "/v1/score": pp.ScoreResponse, "/rerank": pp.RerankResponse, "/v1/rerank": pp.RerankResponse,
        "/v2/rerank": pp.RerankResponse}
EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"},
        "retry": {"type": "integer", "minimum": 0}}}}}
NO_BODY = {"/health": {"200": {"description": "serving"}, "503": {"description": "starting, stopping or restarting"}}}
PLAIN = {"text/plain": {"schema": {"type": "string"}}}
TEXT = {"/metrics": {"200": {"description": "Prometheus' text format", "content": PLAIN}},
        "/v1/load_lora_adapter": {"200": {"description": "vLLM's success line", "content": PLAIN}},
        "/v1/unload_lora_adapter": {"200": {"description": "vLLM's success line", "content": PLAIN}}}


def install(app: FastAPI) -> None:
    """app.openapi() gives the document below (built once, on the first call: every route is in by then)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi


def document(app: FastAPI) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error = {"description": "OpenAI's error object", "content": {"application/json": {"schema": _ref(
        oai.ErrorResponse, schemas)}}}
    anthropic_error = {"description": "Anthropic's error object", "content": {"application/json": {"schema": _ref(
        ap.AnthropicErrorResponse, schemas)}}}
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            responses.pop("422", None)
            if path in STREAMED:
                json_body = {"application/json": {"schema": _ref(STREAMED[path], schemas)}}
                responses["200"] = {"description": "the response, or its chunks as server-sent events with stream",
                                    "content": {**json_body, **EVENT_STREAM}}
            if path in JSON:
                responses["200"] = {"description": "the response", "content": {
                    "application/json": {"schema": _ref(JSON[path], schemas)}}}
            responses.update(NO_BODY.get(path, {}) or TEXT.get(path, {}))
            responses["default"] = anthropic_error if is_messages_path(path) else error
    return doc


def _ref(model: type[BaseModel], schemas: dict) -> dict:
    """A reference to model's schema (as serialized), which goes into the document's components."""
    schema = model.model_json_schema(ref_template=REF, mode="serialization")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}
