"""The gRPC service (serving/), end to end: a real `jaxpage serve` subprocess, called over a real channel.

- 32 concurrent streams give the offline engine's greedy tokens and text; unary, chat and the CLI client work;
- health (grpc.health.v1) and reflection answer; bad input is INVALID_ARGUMENT naming the field;
- a cancelled, disconnected or timed-out stream gives its KV blocks back at once (read from /metrics);
- SIGTERM lets the streams in flight finish, then the server exits 0.
A second server over a stand-in runner (no model, so it starts in seconds) shows RESOURCE_EXHAUSTED for a
full queue, and an engine whose step raises: UNAVAILABLE for the calls in flight, health NOT_SERVING, then a
fresh engine and SERVING again; an engine that keeps dying makes the process exit 1 once its restarts are used.
"""
from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from jaxpage.testing.launch import ROOT, health_status, wait_serving
from jaxpage import SamplingParams
from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc
from tests.servers import ENGINE_FLAGS, NOT_SERVING, SERVING, STAND_IN_SERVER, START_TIMEOUT, greedy, start


@pytest.fixture(scope="session")
def server_started(tmp_path_factory):
    """The real server, launched (session scope, so that it warms up while `smollm2` loads in this process)."""
    server = start(["-m", "serving.cli", "serve", *ENGINE_FLAGS, "--grace-seconds", "60"],
                   tmp_path_factory.mktemp("serve") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def server(server_started):
    wait_serving(server_started.target, server_started.proc, START_TIMEOUT, server_started.log)
    return server_started


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.GenerationStub(channel)




async def stream_all(target: str, requests: list[pb.GenerateRequest]) -> list[dict]:
    """Runs the calls concurrently on one channel; per call: request_id, text, token_ids, finish reason, usage."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(request):
            got = {"request_ids": set(), "text": "", "token_ids": [], "finish_reason": "", "usage": None}
            async for response in stub.GenerateStream(request, timeout=120):
                got["request_ids"].add(response.request_id)
                for c in response.completions:
                    assert c.index == 0 and not got["finish_reason"], "output after the finish"
                    got["text"] += c.text
                    got["token_ids"] += list(c.token_ids)
                    got["finish_reason"] = c.finish_reason
                if response.HasField("usage"):
                    got["usage"] = (response.usage.prompt_tokens, response.usage.completion_tokens)
            return got

        return await asyncio.gather(*(one(r) for r in requests))


# --- the real server -------------------------------------------------------------------------------------
def test_32_concurrent_streams_match_the_offline_engine(server_started, smollm2, server):
    prompts = [f"Fact {i}: the most interesting thing about the number {i * 7} is" for i in range(32)]
    requests = [pb.GenerateRequest(prompt=p, sampling=greedy(16), request_id=f"s{i}" if i % 2 else "")
                for i, p in enumerate(prompts)]
    got = asyncio.run(stream_all(server.target, requests))
    want = smollm2.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    ids = set()
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g["request_ids"]) == 1, g["request_ids"]
        ids |= g["request_ids"]
        if i % 2:
            assert g["request_ids"] == {f"s{i}"}
        assert g["finish_reason"] == "length"
        assert g["usage"] == (len(w.prompt_token_ids), 16)
        assert g["token_ids"] == w.outputs[0].token_ids, f"prompt {i}"
        assert g["text"] == w.outputs[0].text, f"prompt {i}"
    assert len(ids) == 32, "server-made request ids must be unique"


def test_unary_chat_model_info_and_the_cli_client(server, stub):
    request = pb.GenerateRequest(prompt="The capital of France is", sampling=greedy(8))
    unary = stub.Generate(request, timeout=60)
    [streamed] = asyncio.run(stream_all(server.target, [request]))
    [c] = unary.completions
    assert (c.text, list(c.token_ids), c.finish_reason) == (streamed["text"], streamed["token_ids"], "length")
    assert unary.usage.completion_tokens == 8 and unary.usage.prompt_tokens > 0
    assert unary.request_id.startswith("req-")

    chat = stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Say hi.")],
                                            sampling=greedy(4, logprobs=2)), timeout=60)
    [c] = chat.completions
    assert len(c.token_ids) == 4 and len(c.logprobs) == 4
    assert all(c.token_ids[i] in {t.token_id for t in c.logprobs[i].top} for i in range(4))

    per_index: dict[int, list] = {0: [], 1: []}
    reasons: dict[int, list] = {0: [], 1: []}
    for response in stub.GenerateStream(pb.GenerateRequest(
            prompt="Once upon a time", sampling=pb.SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=5,
                                                                  ignore_eos=True)), timeout=60):
        for c in response.completions:
            per_index[c.index] += c.token_ids
            reasons[c.index] += [c.finish_reason] if c.finish_reason else []
    assert [len(per_index[i]) for i in (0, 1)] == [5, 5] and reasons == {0: ["length"], 1: ["length"]}
    assert response.usage.completion_tokens == 10

    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_name.startswith("SmolLM2") and info.max_model_len == 512 and info.block_size == 16
    assert info.num_kv_blocks > 1 and info.max_num_seqs == 32 and info.vocab_size == 49152
    assert info.kv_cache_dtype == "auto"
    assert info.quantization == ""

    cli = subprocess.run([sys.executable, "-m", "serving.cli", "client", "--target", server.target, "--stream",
                          "--max-tokens", "8", "The capital of France is"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == c_text(unary) + "\n"


def c_text(response: pb.GenerateResponse) -> str:
    return "".join(c.text for c in response.completions)


def test_health_and_reflection(server):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    assert health_status(server.target) == SERVING
    assert health_status(server.target, "jaxpage.v1.Generation") == SERVING
    with grpc.insecure_channel(server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert {"jaxpage.v1.Generation", "grpc.health.v1.Health"} <= set(db.get_services())
        service = DescriptorPool(db).FindServiceByName("jaxpage.v1.Generation")
        assert {m.name for m in service.methods} >= {"Generate", "GenerateStream", "GetModelInfo"}


@pytest.mark.parametrize("request_kw, field", [
    (dict(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature"),
    (dict(prompt="hi", sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
    (dict(prompt="hi", sampling=pb.SamplingParams(seed=-3)), "sampling.seed"),
    (dict(prompt="hi", sampling=pb.SamplingParams(max_tokens=4, min_tokens=5)), "sampling.min_tokens"),
    (dict(prompt="hi", sampling=pb.SamplingParams(logprobs=99)), "sampling.logprobs"),
    (dict(prompt="hi", prompt_token_ids=[1, 2]), "exactly one of prompt, prompt_token_ids"),
    (dict(), "exactly one of prompt, prompt_token_ids"),
    (dict(prompt_token_ids=[1] * 600), "max_model_len=512"),
    (dict(prompt_token_ids=[10**6]), "prompt_token_ids"),
    (dict(messages=[pb.ChatMessage(content="no role")]), "messages[0].role"),
])
@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_invalid_arguments_name_the_field(stub, request_kw, field, streaming):
    call = stub.GenerateStream if streaming else stub.Generate
    with pytest.raises(grpc.RpcError) as e:
        result = call(pb.GenerateRequest(**request_kw), timeout=30)
        list(result) if streaming else None
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()


LONG = [100 + i for i in range(200)]  # 13 blocks of 16 tokens


@pytest.mark.parametrize("how", ["cancel", "disconnect", "deadline"])
def test_a_stream_that_ends_early_returns_its_blocks_at_once(server, how):
    before = server.metrics()
    free = before["jaxpage:kv_blocks_free"]
    channel = grpc.insecure_channel(server.target)
    first = {"cancel": 1, "disconnect": 2, "deadline": 3}[how]  # distinct prompts: no prefix-cache sharing
    request = pb.GenerateRequest(prompt_token_ids=[first, *LONG], sampling=greedy(400))
    call = pb_grpc.GenerationStub(channel).GenerateStream(request, timeout=6.0 if how == "deadline" else 120)
    next(call), next(call)  # prefilled and decoding
    assert server.metrics()["jaxpage:kv_blocks_free"] <= free - 13
    if how == "cancel":
        call.cancel()
    elif how == "disconnect":
        channel.close()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == {"cancel": grpc.StatusCode.CANCELLED, "disconnect": grpc.StatusCode.CANCELLED,
                              "deadline": grpc.StatusCode.DEADLINE_EXCEEDED}[how]
    server.assert_freed(free, before, 400, within=3.0)
    channel.close()


def test_metrics_have_vllm_names_and_count_the_request(server, stub):
    before = server.metrics()
    stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8, 9], sampling=greedy(6)), timeout=60)
    after = server.metrics()
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "kv_blocks_free", "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total"):
        assert f"jaxpage:{name}" in after, name
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["jaxpage:time_to_first_token_seconds_count"] == 1
    assert delta["jaxpage:e2e_request_latency_seconds_count"] == 1
    assert delta["jaxpage:inter_token_latency_seconds_count"] == 5
    assert delta["jaxpage:prompt_tokens_total"] == 5 and delta["jaxpage:generation_tokens_total"] == 6
    assert delta["jaxpage:prefix_cache_queries_total"] >= 5
    assert 0 <= after["jaxpage:kv_cache_usage_perc"] <= 1


def test_sigterm_lets_streams_finish_then_exits_0(server):
    """Last on the real server: it stops it."""
    requests = [pb.GenerateRequest(prompt=f"Count to {i}:", sampling=greedy(40)) for i in range(6)]

    async def run():
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            calls = [stub.GenerateStream(r, timeout=120) for r in requests]
            firsts = [await call.read() for call in calls]  # all six admitted and streaming
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            with pytest.raises(grpc.aio.AioRpcError) as e:  # no new calls
                await stub.Generate(pb.GenerateRequest(prompt="late", sampling=greedy(2)), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            tokens = []
            for first, call in zip(firsts, calls):
                ids, response = [], first
                while response is not grpc.aio.EOF:
                    ids += [t for c in response.completions for t in c.token_ids]
                    last, response = response, await call.read()
                tokens.append(len(ids))
                assert last.completions[0].finish_reason == "length"
            return tokens

    assert asyncio.run(run()) == [40] * 6
    assert server.proc.wait(60) == 0
    assert "shutting down: 6 calls in flight" in server.log.read_text()


# --- a stand-in engine: queue limit and engine failure -----------------------------------------------------
@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stand_in")
    flag = tmp / "fail"
    server = start(["-c", STAND_IN_SERVER, str(flag), "--max-queue", "4", "--grace-seconds", "5"],
                   tmp / "server.log")
    wait_serving(server.target, server.proc, START_TIMEOUT, server.log)
    server.fail_flag = flag
    yield server
    server.stop()


def open_streams(stub, n: int, max_tokens: int = 3000):
    calls = [stub.GenerateStream(pb.GenerateRequest(prompt_token_ids=[1, 2, 3 + i], sampling=greedy(max_tokens)),
                                 timeout=60) for i in range(n)]
    for call in calls:
        next(call)  # admitted and generating
    return calls


def test_a_full_queue_is_resource_exhausted(stand_in):
    with grpc.insecure_channel(stand_in.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        calls = open_streams(stub, 4)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], sampling=greedy(2)), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-queue 4" in e.value.details()
        calls[0].cancel()
        stand_in.wait_metric("jaxpage:num_requests_in_flight", lambda v: v == 3)
        assert len(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], sampling=greedy(2)),
                                 timeout=10).completions[0].token_ids) == 2
        for call in calls[1:]:
            call.cancel()
        assert stand_in.wait_metric("jaxpage:num_requests_in_flight", lambda v: v == 0) == 0


def test_an_engine_failure_fails_the_calls_in_flight_and_the_server_restarts_the_engine(stand_in):
    """A device error kills the engine loop: the calls in flight get UNAVAILABLE, health turns NOT_SERVING, and
    the server makes a fresh engine by itself; health turns SERVING again and later calls succeed."""
    with grpc.insecure_channel(stand_in.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        calls = open_streams(stub, 3)
        assert health_status(stand_in.target) == SERVING
        before = stand_in.metrics()
        started = time.monotonic()
        stand_in.fail_flag.write_text("once")
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "injected device error" in e.value.details()
        assert time.monotonic() - started < 5
        seen = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen.add(health_status(stand_in.target))
            if NOT_SERVING in seen and seen & {SERVING} and health_status(stand_in.target) == SERVING:
                break
            time.sleep(0.05)
        assert health_status(stand_in.target) == SERVING, "the engine was not restarted"
        reply = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], sampling=greedy(2)), timeout=10)
        assert list(reply.completions[0].token_ids) == [7, 7]
        after = stand_in.metrics()
        assert after["jaxpage:request_errors_total"] - before.get("jaxpage:request_errors_total", 0) >= 3
    assert "restarting the engine (1 of at most 3)" in stand_in.log.read_text()


@pytest.mark.parametrize("restarts,told", [(2, "the server restarts the engine: retry shortly"),
                                            (0, "no engine restarts are left: the server stops")])
def test_an_engine_that_keeps_dying_makes_the_process_exit_1(tmp_path, restarts, told):
    """Restarts are bounded: a device that fails on every step uses them up, then the process exits non-zero (a
    supervisor restarts it), instead of staying up serving nothing. The call the first death fails hears what
    comes next: a restart, or, with no restarts left (as with several hosts), the server's stop."""
    flag = tmp_path / "fail"
    server = start(["-c", STAND_IN_SERVER, str(flag), "--max-engine-restarts", str(restarts), "--grace-seconds", "1"],
                   tmp_path / "server.log")
    try:
        wait_serving(server.target, server.proc, START_TIMEOUT, server.log)
        flag.write_text("always")
        with grpc.insecure_channel(server.target) as channel:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.GenerationStub(channel).Generate(
                    pb.GenerateRequest(prompt_token_ids=[1], sampling=greedy(2)), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert told in e.value.details(), e.value.details()
        assert server.proc.wait(60) == 1
        assert f"{restarts} restarts are used up: exiting 1" in server.log.read_text()
    finally:
        server.stop()


# --- the generated stubs -------------------------------------------------------------------------------
VERSION_LINES = re.compile(r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*|\s+\d+,)$", re.M)


def test_the_committed_stubs_are_fresh(tmp_path):
    """Regenerated from serving/generation.proto they are the same, up to the generator's version stamps."""
    from serving.codegen import GENERATED, generate

    generate(tmp_path)
    for name in GENERATED:
        fresh, committed = (VERSION_LINES.sub("", p.read_text()) for p in (tmp_path / name, ROOT / name))
        assert fresh == committed, f"{name} is stale: run `python -m serving.codegen`"


def test_an_engine_that_fails_to_load_reports_its_error():
    """The server loads the engine in a thread; the thread's error must reach the server (it used to be lost to a
    NameError in the callback, leaving the server NOT_SERVING for ever)."""
    from serving.server import _in_thread

    def fail():
        raise FileNotFoundError("no such model")

    async def load():
        return await asyncio.wait_for(_in_thread(fail), timeout=30)

    with pytest.raises(FileNotFoundError, match="no such model"):
        asyncio.run(load())
