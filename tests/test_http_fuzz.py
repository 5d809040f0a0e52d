"""A property-based fuzz of the whole HTTP API from its own OpenAPI document (schemathesis against a running
`jaxpage serve`): every operation the document lists, with bodies drawn from its request schemas (valid and
invalid ones), answers no 5xx and only responses that conform to the document (the documented 500/503 are an
engine's failure, and the engine here does not fail); afterwards every KV block is free.

The server runs a tiny random Llama (a byte-level tokenizer of 256 bytes and the chat template's special tokens;
the tool-calling template, tool-call and reasoning parsers on; LoRA with runtime loading, for its endpoints)
through the real runner, with one step bucket of 8 tokens beside the single-token one: it compiles in seconds. The
same model served with --runner pooling is fuzzed on the pooling operations (embeddings, pooling, score, rerank),
whose valid requests a generating model refuses.
"""
from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

from jaxpage.testing.launch import wait_serving
from tests.factories import tiny_llama
from tests.servers import START_TIMEOUT, TEMPLATE, start_http

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "8", "--num-kv-blocks", "160",
         "--dtype", "float32", "--grace-seconds", "5", "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
         "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
         "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--allow-runtime-lora-updating"]
EXAMPLES = 25  # per operation and mode (valid, invalid input)


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (every byte a token) and the chat template's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=SPECIAL[1:],
                                   eos_token=SPECIAL[0], pad_token=SPECIAL[0])


def byte_llama_server(tmp_path_factory, *flags: str):
    """A server of the tiny random Llama with the byte tokenizer, started with flags."""
    from tests.reference import save_random_model

    path = tmp_path_factory.mktemp("byte-llama")
    tokenizer = byte_tokenizer()
    save_random_model(tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=1024), path, seed=0)
    tokenizer.save_pretrained(path)
    server = start_http(["-m", "serving.cli", "serve", "--model", str(path), *flags], path / "server.log")
    try:
        wait_serving(server.target, server.proc, START_TIMEOUT, server.log)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    yield from byte_llama_server(tmp_path_factory, *FLAGS)


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory):
    """The same model served as an embedding model (the pooling endpoints' valid requests reach the engine)."""
    yield from byte_llama_server(tmp_path_factory, *FLAGS[:10], "--runner", "pooling")


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(fuzzed_server.base + "/openapi.json")


def fuzz(operation, mode: GenerationMode, statuses: Counter) -> None:
    """EXAMPLES requests of one operation drawn in mode (valid or invalid input), each checked; their statuses
    counted. An operation without input has no invalid one."""
    def count(ctx, response, case) -> None:
        statuses[response.status_code] += 1

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        case.call_and_validate(checks=[count, not_a_server_error, response_schema_conformance], timeout=60)

    try:
        run()
    except Unsatisfiable:
        assert mode == GenerationMode.NEGATIVE and not operation.body and not operation.query


def fuzz_all(operations) -> dict:
    """Every operation fuzzed in both modes; the statuses each answered, by (operation, mode)."""
    failures, statuses = [], {}
    for operation in operations:
        for mode in GenerationMode:
            statuses[operation.label, mode.value] = Counter()
            try:
                fuzz(operation, mode, statuses[operation.label, mode.value])
            except (Failure, FailureGroup, ExceptionGroup) as e:  # every operation's failures together
                failures.append(f"{operation.label} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)
    return statuses


def test_every_operation_answers_as_its_schema_says(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
            "/v1/embeddings", "/pooling", "/score", "/rerank", "/tokenize", "/detokenize", "/v1/models",
            "/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= {op.path for op in operations}
    statuses = fuzz_all(operations)
    # the valid requests reached the engine: some of each endpoint's were served
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
                 "/detokenize"):
        assert statuses[f"POST {path}", "positive"][200] > 0, statuses


def test_no_block_leaked_after_the_fuzz(fuzzed_server):
    assert fuzzed_server.all_blocks_free()
    after = fuzzed_server.metrics()
    # a labelled gauge has no series until a request reaches admission (the fuzz may admit none)
    assert after["jaxpage:num_requests_running"] == 0 and after.get("jaxpage:num_requests_in_flight", 0) == 0


POOLING_PATHS = ("/v1/embeddings", "/pooling", "/score", "/rerank")


def test_the_pooling_operations_of_an_embedding_model_answer_as_their_schemas_say(pooling_server):
    """The pooling endpoints (and their other paths: /v1/score, /v1/rerank, /v2/rerank) of a pooling model: no 5xx,
    every response conforming; valid requests of each are served; afterwards every block is free."""
    schema = schemathesis.openapi.from_url(pooling_server.base + "/openapi.json")
    operations = [op for op in (result.ok() for result in schema.get_all_operations())
                  if op.path.endswith(("embeddings", "pooling", "score", "rerank"))]
    assert len(operations) == 7
    statuses = fuzz_all(operations)
    for path in POOLING_PATHS:
        assert statuses[f"POST {path}", "positive"][200] > 0, statuses
    assert pooling_server.all_blocks_free()
