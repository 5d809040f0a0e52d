"""LoRA adapters through `jaxpage serve` (one server of a tiny random Llama, its PEFT adapters against PEFT):

- `--lora-modules` (name=path and the JSON form): `/v1/models` lists the base and each adapter with its parent,
  gRPC's GetModelInfo the adapters; an unknown model is OpenAI's 404 naming `model` (gRPC: NOT_FOUND naming
  `lora_name`);
- `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` behind the API key; a bad adapter (no adapter_config.json,
  a rank over --max-lora-rank, an unknown target module, another model's shapes) is a 400 naming the file and
  field, and the server keeps serving;
- four adapters and the base over two device slots and a host LRU of two, requests at once over completions
  (streamed and not), chat and gRPC: every request gets its own adapter's PEFT greedy tokens (the references of
  the five models differ, so a wrong adapter cannot pass), and every KV block comes back;
- unloading an adapter while it streams: its stream ends with its own tokens, new requests naming it get a 404,
  and loading it again serves it again;
- /v1/responses on an adapter: its chat completion.
"""
from __future__ import annotations

import asyncio
import json
import random

import grpc
import httpx
import pytest
import torch

from jaxpage.testing.launch import free_port, spawn, wait_serving
from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc
from tests.factories import SEED, save_word_tokenizer, tiny_llama
from tests.reference import assert_greedy_matches, copy_adapter, hf_greedy, peft_adapter, save_random_model
from tests.servers import KEY, START_TIMEOUT

openai = pytest.importorskip("openai")
pytest.importorskip("peft")
torch.set_num_threads(1)

BASE = "tiny-base"  # --served-model-name
PARENT = "tiny-llama-random"  # a2's base_model_name (JSON form of --lora-modules)
# name -> (rank, lora_alpha, target modules); a large alpha, so that each adapter's outputs are its own
ADAPTERS = {
    "a1": (8, 64, ["q_proj", "v_proj", "o_proj"]),
    "a2": (16, 64, ["gate_proj", "up_proj", "down_proj"]),
    "a3": (8, 64, ["k_proj", "o_proj", "down_proj"]),
    "a4": (16, 48, ["q_proj", "up_proj"]),
}
NEW_TOKENS = 8
AUTH = {"Authorization": f"Bearer {KEY}"}


class LoRAServer:
    def __init__(self, proc, target: str, base: str, log, models: dict, paths: dict):
        self.proc, self.target, self.base, self.log = proc, target, base, log
        self.models, self.paths = models, paths  # name -> PEFT (or base) torch model; name -> adapter directory
        self._refs: dict = {}

    def ref(self, model: str, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list]:
        """The model's greedy tokens and logits (transformers + PEFT, full recomputation)."""
        key = (model, tuple(prompt), n)
        if key not in self._refs:
            self._refs[key] = hf_greedy(self.models[model], prompt, n)
        return self._refs[key]

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def post(self, path: str, body: dict, headers=AUTH) -> httpx.Response:
        return httpx.post(self.base + path, json=body, headers=headers, timeout=60)

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base + "/metrics", headers=AUTH, timeout=10).text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}

    async def all_blocks_free(self) -> bool:
        for _ in range(100):
            m = self.metrics()
            if m["jaxpage:kv_blocks_free"] == m["jaxpage:kv_blocks_total"]:
                return m["jaxpage:num_requests_running"] == 0
            await asyncio.sleep(0.05)
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serving")
    base = save_random_model(tiny_llama(), root / "base", seed=SEED)
    save_word_tokenizer(root / "base", base.config.vocab_size)
    models, paths = {BASE: base}, {}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        paths[name] = root / name
        models[name] = peft_adapter(base, paths[name], rank, alpha, targets, seed=SEED + 1 + i)
    port, http_port = free_port(), free_port()
    a2 = json.dumps({"name": "a2", "path": str(paths["a2"]), "base_model_name": PARENT})
    proc = spawn(["-m", "serving.cli", "serve", "--model", str(root / "base"), "--served-model-name", BASE,
                  "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "16",
                  "--lora-modules", f"a1={paths['a1']}", a2, "--allow-runtime-lora-updating", "--api-key", KEY,
                  "--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
                  "--num-kv-blocks", "64", "--dtype", "float32", "--no-progress", "--cache-dir", str(root / "cache"),
                  "--grace-seconds", "1", "--port", str(port), "--metrics-port", "0", "--http-port", str(http_port)],
                 root / "server.log")
    server = LoRAServer(proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", root / "server.log", models,
                        paths)
    try:
        wait_serving(server.target, proc, START_TIMEOUT, server.log)
        yield server
    finally:
        proc.terminate()
        proc.wait(60)


def _prompt(rng: random.Random, n: int = 20) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


async def _completion(client, model: str, prompt: list[int], stream: bool, n: int = NEW_TOKENS) -> list[int]:
    kw = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
          "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    if not stream:
        return (await client.completions.create(**kw)).choices[0].model_extra["token_ids"]
    tokens = []
    async for chunk in await client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            tokens += c.model_extra.get("token_ids") or []
    return tokens


def _grpc(target: str, lora_name: str, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(target) as channel:
        request = pb.GenerateRequest(prompt_token_ids=prompt, lora_name=lora_name, sampling=pb.SamplingParams(
            temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        response = pb_grpc.GenerationStub(channel).Generate(request, timeout=60, metadata=[("authorization",
                                                                                              f"Bearer {KEY}")])
        return list(response.completions[0].token_ids)


def test_models_list_the_base_and_each_adapter_with_its_parent(served):
    data = httpx.get(served.base + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in data] == [
        (BASE, None, None), ("a1", BASE, str(served.paths["a1"])), ("a2", PARENT, str(served.paths["a2"]))]
    with grpc.insecure_channel(served.target) as channel:
        info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10,
                                                            metadata=[("authorization", f"Bearer {KEY}")])
    assert [(a.name, a.path, a.base_model_name) for a in info.lora_adapters] == [
        ("a1", str(served.paths["a1"]), BASE), ("a2", str(served.paths["a2"]), PARENT)]


def test_an_unknown_model_is_openais_404_naming_model(served):
    for path, body in (("/v1/completions", {"prompt": "t1 t2", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}]})):
        r = served.post(path, {"model": "a9", **body})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"], error["type"]) == ("model", "model_not_found", "invalid_request_error")
        assert "'a9'" in error["message"] and "'a1'" in error["message"]
    with pytest.raises(grpc.RpcError) as e:
        _grpc(served.target, "a9", [1, 2, 3])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "lora_name='a9'" in e.value.details()


def test_loading_is_behind_the_api_key_and_a_bad_adapter_is_a_400_naming_file_and_field(served, tmp_path):
    src = served.paths["a1"]
    assert served.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(src)}, {}).status_code == 401
    assert served.post("/v1/unload_lora_adapter", {"lora_name": "a1"}, {}).status_code == 401
    other = tmp_path / "other"  # an adapter of a wider model: its tensors do not fit this one's
    peft_adapter(save_random_model(tiny_llama(hidden_size=96), tmp_path / "other-base", SEED), other, 8, 16,
                 ["q_proj"])
    bad = {"missing": (tmp_path / "missing", ["adapter_config.json", "no such file"]),
           "rank": (copy_adapter(src, tmp_path / "rank", r=32), ["adapter_config.json", "r=32", "max_lora_rank=16"]),
           "target": (copy_adapter(src, tmp_path / "target", target_modules=["q_proj", "c_attn"]),
                      ["adapter_config.json", "target_modules", "c_attn"]),
           "shapes": (other, ["adapter_model.safetensors", "q_proj.lora_A", "shape"])}
    for name, (path, words) in bad.items():
        r = served.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert error["param"] == "lora_path" and all(w in error["message"] for w in words), (name, error)
    r = served.post("/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(src)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    r = served.post("/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name", r.text
    models = [m["id"] for m in httpx.get(served.base + "/v1/models", headers=AUTH, timeout=10).json()["data"]]
    assert models == [BASE, "a1", "a2"]
    prompt = _prompt(random.Random(SEED))  # still serving, with a good adapter
    ours = asyncio.run(_completion(served.client(), "a1", prompt, stream=False))
    assert_greedy_matches(ours, *served.ref("a1", prompt), f"seed {SEED}, a1 after the refusals")


def test_every_request_gets_its_own_adapter_over_two_slots(served):
    for name in ("a3", "a4"):
        r = served.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(served.paths[name])})
        assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{name}' added successfully.", r.text
    rng = random.Random(SEED + 100)
    prompts = [_prompt(rng), _prompt(rng)]
    names = [BASE, *ADAPTERS]
    for prompt in prompts:  # the five models disagree on every prompt: a request served wrongly cannot pass
        refs = {tuple(served.ref(name, prompt)[0]) for name in names}
        assert len(refs) == len(names), f"seed {SEED}: two models give the same tokens; the test cannot tell them"
    words = [rng.randrange(1, 256) for _ in range(12)]
    chat = {"role": "user", "content": " ".join(f"t{w}" for w in words)}

    async def chat_tokens(client, model):
        r = await client.chat.completions.create(model=model, messages=[chat], max_tokens=NEW_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.model_extra["prompt_token_ids"] == words
        return r.choices[0].model_extra["token_ids"]

    async def run():
        client = served.client()
        calls = [(name, p, i % 2 == 1) for i, (name, p) in enumerate((n, p) for p in prompts for n in names)]
        jobs = [_completion(client, name, p, stream) for name, p, stream in calls]
        jobs += [chat_tokens(client, "a3"), chat_tokens(client, "a4")]
        jobs += [asyncio.to_thread(_grpc, served.target, name, prompts[0]) for name in ("a2", "a4")]
        got = await asyncio.gather(*jobs)
        wants = [(name, p) for name, p, _ in calls] + [("a3", words), ("a4", words), ("a2", prompts[0]),
                                                       ("a4", prompts[0])]
        for (name, p), ours in zip(wants, got):
            assert_greedy_matches(ours, *served.ref(name, p), f"seed {SEED}, {name}, prompt {p[:4]}...")
        assert await served.all_blocks_free(), "KV blocks leaked"

    asyncio.run(run())


def test_unloading_an_adapter_while_it_streams(served):
    rng = random.Random(SEED + 200)
    prompt, n, long = _prompt(rng), 24, 100  # a3's stream is long: it still runs when its unload returns
    names = [BASE, "a1", "a3", "a4"]
    done = set()

    async def stream(client, name, first: asyncio.Event | None):
        kw = {"model": name, "prompt": prompt, "max_tokens": long if first else n, "temperature": 0, "stream": True,
              "extra_body": {"ignore_eos": True, "return_token_ids": True}}
        tokens = []
        async for chunk in await client.completions.create(**kw):
            for c in chunk.choices:
                tokens += c.model_extra.get("token_ids") or []
            if first is not None and tokens:
                first.set()
        done.add(name)
        return tokens

    async def run():
        client = served.client()
        streaming = asyncio.Event()  # a3 has tokens: it is running when it is unloaded
        tasks = [asyncio.ensure_future(stream(client, name, streaming if name == "a3" else None)) for name in names]
        await asyncio.wait_for(streaming.wait(), 60)
        r = await asyncio.to_thread(served.post, "/v1/unload_lora_adapter", {"lora_name": "a3"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a3' removed successfully.", r.text
        assert "a3" not in done, "a3's stream ended before its unload: nothing was unloaded under a stream"
        with pytest.raises(openai.NotFoundError):
            await _completion(client, "a3", prompt, stream=False)
        for name, ours in zip(names, await asyncio.gather(*tasks)):
            assert_greedy_matches(ours, *served.ref(name, prompt, long if name == "a3" else n),
                                  f"seed {SEED}, {name} (a3 unloaded)")
        assert await served.all_blocks_free(), "KV blocks leaked"

    asyncio.run(run())
    models = [m["id"] for m in httpx.get(served.base + "/v1/models", headers=AUTH, timeout=10).json()["data"]]
    assert models == [BASE, "a1", "a2", "a4"]
    r = served.post("/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(served.paths["a3"])})
    assert r.status_code == 200, r.text
    ours = asyncio.run(_completion(served.client(), "a3", prompt, stream=True))
    assert_greedy_matches(ours, *served.ref("a3", prompt), f"seed {SEED}, a3 loaded again")
    assert served.post("/v1/unload_lora_adapter", {"lora_name": "a4"}).status_code == 200  # idle: forgotten
    assert served.post("/v1/completions", {"model": "a4", "prompt": prompt}).status_code == 404
    ours = asyncio.run(_completion(served.client(), "a1", prompt, stream=False))
    assert_greedy_matches(ours, *served.ref("a1", prompt), f"seed {SEED}, a1 after a4's unload")


def test_a_bad_lora_module_stops_the_start_and_is_served_no_more_after_a_restart():
    """ServingModels.check_all over a stand-in engine whose add_lora refuses one adapter as the engine does (a
    ValueError naming the file): at start-up the server does not start, naming the module; after an engine
    restart (its files changed meanwhile) the others are still served."""
    from types import SimpleNamespace

    from serving.serving_models import LoRAModulePath, ServingModels

    class Engine:
        engine = SimpleNamespace(model_name="base")

        async def add_lora(self, request):
            if request.lora_name == "bad":
                raise ValueError(f"{request.lora_path}/adapter_config.json: no such file")

    modules = [LoRAModulePath("good", "/a/good"), LoRAModulePath("bad", "/a/bad")]
    with pytest.raises(ValueError, match="--lora-modules bad: /a/bad/adapter_config.json: no such file"):
        asyncio.run(ServingModels(None, None, modules).check_all(Engine()))
    models = ServingModels(None, None, modules)
    asyncio.run(models.check_all(Engine(), restart=True))
    assert list(models.adapters) == ["good"]
    with pytest.raises(ValueError, match="the base model's name too"):
        asyncio.run(ServingModels(None, None, [LoRAModulePath("base", "/a/x")]).check_all(Engine()))


def test_responses_run_on_the_adapter_their_model_names(served):
    """/v1/responses resolves model as chat does: an adapter's response is its chat completion, whose tokens are
    the adapter's PEFT greedy tokens up to the first end-of-sequence token."""
    words = [random.Random(SEED + 300).randrange(1, 256) for _ in range(10)]
    text = " ".join(f"t{w}" for w in words)
    eos = served.models[BASE].config.eos_token_id

    async def run():
        client = served.client()
        return await asyncio.gather(
            client.responses.create(model="a2", input=text, max_output_tokens=NEW_TOKENS, temperature=0),
            client.chat.completions.create(model="a2", messages=[{"role": "user", "content": text}],
                                           max_tokens=NEW_TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True}))

    response, chat = asyncio.run(run())
    ref, ref_logits = served.ref("a2", words)
    ref = ref[:ref.index(eos) + 1] if eos in ref else ref
    assert_greedy_matches(chat.choices[0].model_extra["token_ids"], ref, ref_logits[:len(ref)], f"seed {SEED}")
    assert response.model == "a2" and response.output_text == chat.choices[0].message.content


def test_the_cli_client_takes_an_adapter_by_name(served, capsys):
    """`jaxpage client --lora-name a1` gives the text of the HTTP completion naming a1; --info lists the adapters."""
    from serving.cli import main

    text = " ".join(f"t{w}" for w in _prompt(random.Random(SEED + 400), 10))
    flags = ["client", "--target", served.target, "--api-key", KEY, "--max-tokens", str(NEW_TOKENS)]
    assert main([*flags, "--lora-name", "a1", text]) == 0
    ours = capsys.readouterr().out
    want = served.post("/v1/completions", {"model": "a1", "prompt": text, "max_tokens": NEW_TOKENS,
                                           "temperature": 0}).json()["choices"][0]["text"]
    base = served.post("/v1/completions", {"prompt": text, "max_tokens": NEW_TOKENS, "temperature": 0}).json()
    assert ours == want + "\n" and want != base["choices"][0]["text"]
    assert main([*flags, "--info"]) == 0
    assert 'name: "a1"' in capsys.readouterr().out
