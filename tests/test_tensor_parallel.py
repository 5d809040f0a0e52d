"""Tensor parallelism against tensor_parallel_size=1, on 8 forced CPU devices.

The forced devices must be set before JAX starts, so the one test collected in the ordinary run re-runs this
file under pytest in a child process with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``; the cases
below run there only. For random models whose heads divide the TP size (one with fewer KV heads than the TP size,
one with q/k/v biases, unrolled layers, int8 weights, an int8 KV pool, a Mixtral MoE, a Qwen3 MoE with q/k norms,
a Gemma 2 with a sliding window and soft caps) and SmolLM2 at TP 3 (9 heads, 3 KV heads):
- greedy tokens identical to TP 1, through ``LLM.generate`` (XLA path; one case on each interpreted Pallas
  kernel, TPU and GPU); seeded sampling under structured-output constraints with log-probabilities too; a workload with a small pool, swap preemption, prefix caching and parallel sampling (copy-on-write)
  gives TP 1's tokens too;
- teacher-forced logits within float32 tolerance of TP 1's;
- the KV pool really is split: each device holds 1/TP of it, its share of the KV head slots;
- the step with the Triton kernel lowers for four GPUs (the CUDA lane at TP 4), SmolLM2's multi-LoRA step for three;
- speculative decoding (n-gram, and a draft model on the first device) at TP 2: TP 1's tokens;
- multi-LoRA: two random PEFT adapters and the base model in one batch at TP 2 and at TP 8 (KV heads replicated)
  give each sequence its own PEFT model's greedy tokens; each device holds its share of the slots (column-parallel
  B, row-parallel A split), and an adapter's slot write gathers nothing;
- the LM head and the sampler work on each device's slice of the vocabulary (no array spans all of it), and the
  sampler so split gives the one-device sampler's tokens for every sampling setting; SmolLM2's prompt logprobs
  at TP 3 are TP 1's;
- checkpoints published quantized (compressed-tensors W4A16 with zero points, AWQ, block-scaled FP8, in groups of
  16 inputs) at TP 2 and 4: TP 1's greedy tokens, each device holding its share of the packed weights and of their
  scales (row-parallel: its groups);
- sizes that cannot work are refused by name.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

from tests.factories import run_on_forced_devices

NUM_DEVICES = 8
IN_CHILD = os.environ.get("JAXPAGE_TP_CHILD") == "1"


@pytest.mark.skipif(IN_CHILD, reason="the parent's test")
def test_tensor_parallel_on_eight_cpu_devices():
    run_on_forced_devices(__file__, NUM_DEVICES, "JAXPAGE_TP_CHILD")


if IN_CHILD:
    import jax
    import numpy as np
    from transformers import Gemma2Config, MixtralConfig, Qwen2Config, Qwen3MoeConfig

    from jaxpage import LLM, SamplingParams
    from tests.factories import EIGHT_HEADS, SMOLLM2_OPTIONS, engine_options, tiny_llama
    from tests.reference import assert_logits_close, paged_logits, save_random_model

    assert len(jax.devices()) == NUM_DEVICES, jax.devices()

    OPTIONS = engine_options(preemption_mode="swap")
    COMMON = dict(num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-5, hidden_act="silu")
    CONFIGS = {  # name -> (config, engine options)
        "llama-8h-4kv": (tiny_llama(**EIGHT_HEADS), {}),
        "qwen2-4h-2kv-bias-unrolled": (Qwen2Config(  # KV heads replicated at TP 4; q/k/v biases; unrolled layers
            vocab_size=192, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=True, **COMMON), dict(scan_layers=False)),
        "llama-8h-4kv-int8": (tiny_llama(**{**EIGHT_HEADS, "tie_word_embeddings": True}), dict(quantization="int8")),
        "mixtral-4h-1kv-moe": (MixtralConfig(  # top 2 of 4 experts; its one KV head replicated at TP 2
            vocab_size=192, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False,
            **COMMON), {}),
        "llama-8h-4kv-kv-int8": (tiny_llama(**EIGHT_HEADS), dict(kv_cache_dtype="int8")),
        "qwen3moe-4h-2kv-qknorm": (Qwen3MoeConfig(  # q/k norms per head; top 2 of 8 experts
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            tie_word_embeddings=True, **COMMON), {}),
        "gemma2-4h-2kv-window-softcaps": (Gemma2Config(  # a sliding layer (window 8) then a full one; soft caps
            vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, query_pre_attn_scalar=24, sliding_window=8, layer_types=["sliding_attention",
            "full_attention"], attn_logit_softcapping=5.0, final_logit_softcapping=20.0, tie_word_embeddings=True,
            **{**COMMON, "hidden_act": "gelu_pytorch_tanh"}), {}),
    }
    CASES = [("llama-8h-4kv", 2, "xla"), ("llama-8h-4kv", 4, "xla"), ("qwen2-4h-2kv-bias-unrolled", 4, "xla"),
             ("qwen2-4h-2kv-bias-unrolled", 4, "pallas_tpu"), ("llama-8h-4kv-int8", 4, "xla"),
             ("mixtral-4h-1kv-moe", 2, "xla"), ("gemma2-4h-2kv-window-softcaps", 4, "xla"),
             ("llama-8h-4kv-kv-int8", 4, "xla"), ("llama-8h-4kv-kv-int8", 2, "pallas_gpu"),
             ("qwen3moe-4h-2kv-qknorm", 2, "xla")]
    GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
    # checkpoints published quantized: name -> (the float model it is made of, its form); groups of 16 inputs
    PUBLISHED = {"llama-8h-4kv-w4a16-asym": ("llama-8h-4kv", "W4A16_ASYM"), "llama-8h-4kv-awq": ("llama-8h-4kv", "awq"),
                 "llama-8h-4kv-fp8-block": ("llama-8h-4kv", "fp8")}
    PUBLISHED_CASES = [("llama-8h-4kv-w4a16-asym", 4), ("llama-8h-4kv-awq", 2), ("llama-8h-4kv-fp8-block", 4)]

    @functools.cache
    def model_dir(name: str) -> str:
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"jaxpage-tp-{os.getpid()}" / name
        save_random_model(CONFIGS[name][0], path, seed=sum(map(ord, name)))
        return str(path)

    @functools.cache
    def published_dir(name: str) -> str:
        from tests.quantized_checkpoints import save_awq, save_compressed, save_fp8_blocks

        base, form = PUBLISHED[name]
        path = Path(model_dir(base)).parent / name
        float_model = save_random_model(CONFIGS[base][0], path.parent / f"{name}-float", seed=sum(map(ord, base)))
        if form == "fp8":
            save_fp8_blocks(float_model, path, (16, 16))
        else:
            save_compressed(float_model, path.parent / f"{name}-ct", "W4A16_ASYM", group_size=16)
            (save_awq if form == "awq" else lambda src, dst: dst.symlink_to(src))(path.parent / f"{name}-ct", path)
        return str(path)

    @functools.cache
    def engine(name: str, tp: int, backend: str) -> LLM:
        if name in PUBLISHED:
            return LLM(model=published_dir(name), tensor_parallel_size=tp, attention_backend=backend, **OPTIONS)
        if name in ("smollm2", "smollm2-gguf-q4_1"):  # the latter: its GGUF's Q4_1 Linears kept as stored
            return LLM(tensor_parallel_size=tp, attention_backend=backend,
                       quantization="gguf" if name == "smollm2-gguf-q4_1" else None,
                       **{**SMOLLM2_OPTIONS, "max_num_batched_tokens": 16, "max_num_seqs": 8, "max_model_len": 128})
        return LLM(model=model_dir(name), tensor_parallel_size=tp, attention_backend=backend,
                   **{**OPTIONS, **CONFIGS[name][1]})

    def prompts(vocab: int, lengths=(1, 15, 17)) -> list[dict]:
        rng = np.random.default_rng(len(lengths))
        return [{"prompt_token_ids": rng.integers(1, vocab, n).tolist()} for n in lengths]

    def tokens(llm: LLM, batch, params=GREEDY) -> list[list[list[int]]]:
        return [[c.token_ids for c in out.outputs] for out in llm.generate(batch, params)]

    @pytest.mark.parametrize("name,tp,backend", CASES, ids=[f"{n}-tp{t}-{b}" for n, t, b in CASES])
    def test_greedy_tokens_equal_tp1(name, tp, backend):
        batch = prompts(CONFIGS[name][0].vocab_size)
        assert tokens(engine(name, tp, backend), batch) == tokens(engine(name, 1, backend), batch)

    @pytest.mark.parametrize("name,tp", [("llama-8h-4kv", 4), ("qwen2-4h-2kv-bias-unrolled", 4)])
    def test_teacher_forced_logits_close_to_tp1(name, tp):
        ids = prompts(CONFIGS[name][0].vocab_size, (40,))[0]["prompt_token_ids"]
        ours, ref = paged_logits(engine(name, tp, "xla"), ids), paged_logits(engine(name, 1, "xla"), ids)
        assert_logits_close(ours, ref, rtol=1e-5, context=f"{name} tp{tp}")

    @pytest.mark.parametrize("name,tp", PUBLISHED_CASES, ids=[f"{n}-tp{t}" for n, t in PUBLISHED_CASES])
    def test_published_quantized_checkpoints_split_and_give_tp1_tokens(name, tp):
        """The packed kernels and their scales are split as the float kernels are (column-parallel: outputs;
        row-parallel o_proj and down_proj: inputs, so each device holds its groups); greedy tokens are TP 1's."""
        llm = engine(name, tp, "xla")
        cfg = llm.engine.config.model
        assert cfg.quantization_group_size == 16 and cfg.quantized_weights in ("int4", "fp8"), cfg
        layers = llm.engine.runner.params["layers"]
        leaves = {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(layers)}
        quantized = {k: v for k, v in leaves.items() if k.endswith("['kernel']") and v.dtype.itemsize == 1}
        assert len(quantized) >= 4, list(leaves)
        for key, kernel in quantized.items():
            scale = leaves[key.replace("['kernel']", "['scale']")]
            for array in (kernel, scale):
                shards = array.addressable_shards
                assert len({s.device for s in shards}) == tp and all(
                    s.data.size * tp == array.size for s in shards), (key, array.shape, array.sharding)
        batch = prompts(CONFIGS[PUBLISHED[name][0]][0].vocab_size)
        assert tokens(llm, batch) == tokens(engine(name, 1, "xla"), batch)

    def test_swap_prefix_caching_and_forks_give_tp1_tokens():
        """More work than the 9-block pool holds (swap preemption), prompts sharing a prefix (prefix caching)
        and n=2 seeded sampling (forks, copy-on-write)."""
        name, vocab = "llama-8h-4kv", CONFIGS["llama-8h-4kv"][0].vocab_size
        shared = prompts(vocab, (20,))[0]["prompt_token_ids"]
        batch = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in prompts(vocab, (3, 9, 14, 5))]
        params = SamplingParams(max_tokens=30, temperature=0.8, n=2, seed=7)
        ours, ref = engine(name, 2, "xla"), engine(name, 1, "xla")
        assert tokens(ours, batch, params) == tokens(ref, batch, params)
        stats = ours.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats

    @pytest.mark.parametrize("name,tp", [("llama-8h-4kv", 4), ("qwen2-4h-2kv-bias-unrolled", 4)])
    def test_each_device_holds_its_share_of_the_pool(name, tp):
        pool = engine(name, tp, "xla").engine.runner.kv_pool
        kv_slots = max(CONFIGS[name][0].num_key_value_heads, tp)
        assert pool.shape[3] == kv_slots
        shards = pool.addressable_shards
        assert len({s.device for s in shards}) == tp
        for s in shards:
            assert s.data.shape == (*pool.shape[:3], kv_slots // tp, *pool.shape[4:])
        assert sum(s.data.nbytes for s in shards) == pool.nbytes

    @functools.cache
    def spec_engine(tp: int, method: str) -> LLM:
        """llama-8h-4kv with speculative decoding: n-gram, a draft model (a 1-layer random Llama of the same
        vocabulary, other weights: drafts accepted and rejected), or a random EAGLE-3 head."""
        if method == "ngram":
            config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                      "prompt_lookup_min": 1}
        elif method == "eagle3":
            from tests.eagle3_heads import eagle3_config, save_random_head

            head = Path(model_dir("llama-8h-4kv")).parent / "eagle3-head"
            if not head.exists():
                save_random_head(head, tiny_llama(**EIGHT_HEADS), (0, 1), 128, seed=6)
            config = eagle3_config(head, 3)
        else:
            draft = Path(model_dir("llama-8h-4kv")).parent / "draft-1-layer"
            if not draft.exists():
                save_random_model(tiny_llama(**{**EIGHT_HEADS, "num_hidden_layers": 1}), draft, seed=5)
            config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
        return LLM(model=model_dir("llama-8h-4kv"), tensor_parallel_size=tp, attention_backend="xla",
                   speculative_config=config, **OPTIONS)

    def spec_prompts() -> list[dict]:
        rng = np.random.default_rng(5)
        return [{"prompt_token_ids": (rng.integers(1, 256, 3 + i).tolist() * 6)[:20]} for i in range(4)]

    @pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
    def test_speculative_decoding_at_tp2_gives_tp1_tokens(method):
        """A TP 2 target verifying n-gram, draft-model or EAGLE-3 drafts (the draft model or head whole on the
        target's first device; the head reads the TP target's hidden states): greedy tokens equal TP 1's without
        speculation; seeded samples with penalties equal TP 1's with the same speculation (rejection sampling over
        each device's slice of the vocabulary gives one device's draws); drafts accepted; every block back."""
        ours, spec1, plain = spec_engine(2, method), spec_engine(1, method), engine("llama-8h-4kv", 1, "xla")
        if method != "ngram":
            drafter = ours.engine.drafter
            pool = drafter.kv_pool if method == "eagle3" else drafter.runner.kv_pool
            assert {s.device for s in pool.addressable_shards} == {jax.devices()[0]}
        batch, greedy = spec_prompts(), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        expected = tokens(plain, batch, greedy)
        # both spec engines in the same state (a draft's tokens may be drawn only with the same schedule, which
        # prefix-cache hits change)
        assert tokens(ours, batch, greedy) == expected == tokens(spec1, batch, greedy)
        sampled = [SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True, frequency_penalty=0.3,
                                  repetition_penalty=1.1) for i in range(len(batch))]
        assert tokens(ours, batch, sampled) == tokens(spec1, batch, sampled)
        stats = ours.stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]

    GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    SAMPLED_PROMPTS = ["A phone number:", "The review was great. Sentiment:", "Once upon a time"]

    @functools.cache
    def smollm2_outputs(tp: int) -> list:
        """SmolLM2's outputs at TP ``tp`` of every request the SmolLM2 tests below check, in one generate call
        (a step costs about the same for one row as for eight here): greedy prompts; seeded sampling under a
        regex, a choice and top-k/top-p, with top log-probabilities; a 40-token prompt with prompt logprobs, in
        three chunks of the 16-token budget."""
        from jaxpage.structured_outputs import StructuredOutputsParams

        llm = engine("smollm2", tp, "xla")
        sampled = dict(max_tokens=14, temperature=0.9, seed=11, logprobs=3)
        params = [GREEDY] * len(GREEDY_PROMPTS) + [
            SamplingParams(**sampled, structured_outputs=StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}")),
            SamplingParams(**sampled, structured_outputs=StructuredOutputsParams(choice=["positive", "negative",
                                                                                         "neutral"])),
            SamplingParams(**sampled, top_k=20, top_p=0.9, repetition_penalty=1.2),
            SamplingParams(prompt_logprobs=3, max_tokens=1, temperature=0)]
        ids = llm.get_tokenizer()("The printing press spread across Europe. " * 8)["input_ids"][:40]
        return llm.generate(GREEDY_PROMPTS + SAMPLED_PROMPTS + [{"prompt_token_ids": ids}], params)

    def test_smollm2_gguf_kept_as_q4_1_at_tp3_gives_tp1_tokens():
        """SmolLM2's Q4_1 Linears kept as stored at TP 3: a row-parallel projection's device holds its 6 (o) and
        16 (down) of the 18 and 48 blocks of 32 inputs, with their scales and zero points; TP 1's greedy tokens."""
        llm = engine("smollm2-gguf-q4_1", 3, "xla")
        down = llm.engine.runner.params["layers"]["mlp"]["down"]
        for leaf in ("kernel", "scale", "zero"):
            assert all(s.data.shape[1] * 3 == down[leaf].shape[1] for s in down[leaf].addressable_shards), leaf
        ours, ref = (tokens(engine("smollm2-gguf-q4_1", tp, "xla"), GREEDY_PROMPTS) for tp in (3, 1))
        assert ours == ref and all(len(t[0]) == GREEDY.max_tokens for t in ours)

    def test_smollm2_tp3_greedy_tokens_equal_tp1():
        llm = engine("smollm2", 3, "xla")
        model = llm.engine.config.model
        assert (model.num_heads, model.num_kv_heads) == (9, 3)
        n = len(GREEDY_PROMPTS)
        ours, ref = ([o.outputs[0].token_ids for o in smollm2_outputs(tp)[:n]] for tp in (3, 1))
        assert ours == ref and all(len(t) == GREEDY.max_tokens for t in ours)
        assert llm.engine.runner.kv_pool.addressable_shards[0].data.shape[3] == 1  # 3 KV heads over 3 devices

    def test_smollm2_tp3_structured_sampled_outputs_and_logprobs_equal_tp1():
        """Seeded sampling under a regex, a choice and top-k/top-p, with top log-probabilities, at TP 3 (each
        device samples from its third of the vocabulary and of each row's token bitmask): TP 1's tokens and
        top-token ids, log-probabilities within float32 rounding."""
        n = len(GREEDY_PROMPTS)
        ours, ref = (smollm2_outputs(tp)[n:n + len(SAMPLED_PROMPTS)] for tp in (3, 1))
        for a, b in zip(ours, ref):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for mine, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert mine.keys() == theirs.keys()
                np.testing.assert_allclose(list(mine.values()), list(theirs.values()), rtol=1e-4, atol=1e-4)
        assert ours[1].outputs[0].text in ("positive", "negative", "neutral")

    def test_smollm2_tp3_prompt_logprobs_equal_tp1():
        """Prompt logprobs at TP 3 (each device's top ids of its third of the vocabulary, gathered; the prompt
        token's log-probability from the device holding it), a 40-token prompt in three chunks of the 16-token
        budget: TP 1's top ids, log-probabilities within float32 rounding."""
        ours, ref = (smollm2_outputs(tp)[-1] for tp in (3, 1))
        assert len(ours.prompt_logprobs) == 40 and ours.prompt_logprobs[0] is None
        for mine, theirs in zip(ours.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert mine.keys() == theirs.keys()
            np.testing.assert_allclose(list(mine.values()), [theirs[t] for t in mine], rtol=1e-4, atol=1e-4)

    def test_lm_head_and_sampler_never_hold_the_full_logits():
        """SmolLM2 at TP 3: each device's LM head and sampler see its own third of the 49152-token vocabulary;
        no array of the compiled step (per device, after partitioning) spans the whole vocabulary."""
        llm = engine("smollm2", 3, "xla")
        vocab, runner = llm.engine.config.model.vocab_size, llm.engine.runner
        hlo = "\n".join(runner.executable(t).as_text() for t in runner.config.token_buckets())
        assert re.search(rf"f32\[\d+,{vocab // 3}\]", hlo)  # the logits, split
        assert not re.search(rf"[\[,]{vocab}[\],]", hlo), re.findall(rf".*[\[,]{vocab}[\],].*", hlo)[:3]

    @pytest.mark.parametrize("tp,vocab", [(2, 100), (3, 192), (4, 256), (8, 49152)])
    def test_sampler_split_by_vocabulary_equals_one_device(tp, vocab):
        """The sampler on logits split by vocabulary over a TP mesh against the one-device sampler: the same
        tokens (seeded random draws, top-k, top-p, min-p, penalties, bans, logit biases, structured-output
        bitmasks, ties), the same top log-probabilities and ids, log-probabilities within float32 rounding. Slices
        of 50 and 64 tokens start inside bitmask words."""
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxpage.distributed.parallel import make_mesh, with_mesh
        from jaxpage.worker.sampler import sample

        mesh = make_mesh(tp)
        split, whole = NamedSharding(mesh, PartitionSpec(None, "model")), NamedSharding(mesh, PartitionSpec())
        sharded = jax.jit(with_mesh(sample, mesh), in_shardings=(split, whole), out_shardings=whole)
        rng = np.random.default_rng(tp)
        logits = (rng.normal(size=(8, vocab)) * 3).astype(np.float32)
        logits[0, [5, vocab - 7]] = logits[0].max() + 1  # a tie across devices: the lower id wins
        for sampling in (mixed_sampling(vocab, rng), mixed_sampling(vocab, rng, greedy=True)):
            ours, ref = sharded(jax.device_put(logits, split), sampling), jax.jit(sample)(jnp.asarray(logits), sampling)
            np.testing.assert_array_equal(ours.tokens, ref.tokens)
            np.testing.assert_array_equal(ours.top_ids, ref.top_ids)
            np.testing.assert_allclose(ours.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(ours.top_logprobs, ref.top_logprobs, rtol=1e-5, atol=1e-5)
        assert int(ref.tokens[0]) == 5

    def mixed_sampling(vocab: int, rng, greedy: bool = False):
        """Eight rows, each with its own setting: greedy, plain random, top-k, top-p, min-p, penalties, a bitmask
        of allowed tokens, a logit bias, all of them at once (all greedy when ``greedy``)."""
        from jaxpage.sampling_params import MAX_LOGIT_BIAS
        from jaxpage.worker.sampler import MAX_BANNED, SamplingBatch

        rows = 8
        temperature = np.array([0, 1.0, 0.7, 1.0, 1.0, 0.9, 1.0, 0.8], np.float32) * (not greedy)
        top_k, top_p = np.array([0, 0, 5, 0, 0, 0, 0, 40], np.int32), np.array([1, 1, 1, .8, 1, 1, 1, .9], np.float32)
        min_p = np.array([0, 0, 0, 0, .1, 0, 0, .05], np.float32)
        penalty = np.array([0, 0, 0, 0, 0, 1, 0, 1], np.float32)
        history = np.full((2, 40), -1, np.int32)
        history[1, :30] = rng.integers(0, vocab, 30)
        words = -(-vocab // 32)
        allowed = np.full((rows, words), -1, np.int32)
        allowed[6:] = rng.integers(-2**31, 2**31, size=(2, words), dtype=np.int64).astype(np.int32)
        banned = np.full((rows, MAX_BANNED), -1, np.int32)
        banned[:, :2] = [3, vocab - 1]
        bias_ids, bias = np.full((rows, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
        bias_ids[1:4, :3], bias[1:4, :3] = [5, vocab // 2, vocab - 2], [4.0, -3.0, 2.5]
        return SamplingBatch(temperature, top_k, top_p, min_p, np.arange(rows, dtype=np.uint32),
                             np.arange(rows, dtype=np.int32) * 3, 0.5 * penalty, 0.2 * penalty, 1 + 0.3 * penalty,
                             history, penalty.astype(np.int32), np.full(rows, 5, np.int32), banned, np.bool_(True),
                             allowed, bias_ids, bias)

    # LoRA under TP: two random PEFT adapters of llama-8h-4kv, served at TP 2 (4 KV heads split) and TP 8 (the KV
    # heads replicated twice: each device one query head of its KV head's two)
    LORA_ADAPTERS = {1: (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),  # rank, alpha, targets, rsLoRA
                     2: (16, 32, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], True)}

    @functools.cache
    def lora_adapters() -> dict:
        """lora_int_id -> (LoRARequest, PEFT model) of llama-8h-4kv, and None -> (None, the base model)."""
        import torch
        from transformers import AutoModelForCausalLM

        from jaxpage.lora.request import LoRARequest
        from tests.reference import peft_adapter

        base = AutoModelForCausalLM.from_pretrained(model_dir("llama-8h-4kv"), dtype=torch.float32,
                                                    attn_implementation="eager").eval()
        out = {None: (None, base)}
        for lora_id, (rank, alpha, targets, rslora) in LORA_ADAPTERS.items():
            path = Path(model_dir("llama-8h-4kv")).parent / f"llama-8h-4kv-adapter{lora_id}"
            model = peft_adapter(base, path, rank, alpha, targets, rslora, seed=lora_id)
            out[lora_id] = (LoRARequest(f"adapter{lora_id}", lora_id, str(path)), model)
        return out

    @functools.cache
    def lora_engine(tp: int) -> LLM:
        return LLM(model=model_dir("llama-8h-4kv"), tensor_parallel_size=tp, enable_lora=True, max_loras=2,
                   max_lora_rank=16, **OPTIONS)

    @pytest.mark.parametrize("tp", [2, 8])
    def test_lora_adapters_and_the_base_in_one_batch_match_peft(tp):
        """Adapters 1 and 2 and the base model interleaved in one generate call, at TP 2 and at TP 8 (KV heads
        replicated, k/v's B columns with them): each sequence's greedy tokens are its own PEFT model's (the
        reference test_lora holds TP 1 to)."""
        import torch

        from tests.reference import assert_greedy_matches, hf_greedy

        adapters = lora_adapters()
        order = [1, None, 2, 1]
        batch = prompts(CONFIGS["llama-8h-4kv"][0].vocab_size, (5, 15, 17, 9))
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        outs = lora_engine(tp).generate(batch, params, lora_request=[adapters[i][0] for i in order])
        assert len(outs) == len(order)
        torch.set_num_threads(1)
        changed = 0
        for lora_id, prompt, out in zip(order, batch, outs):
            ref, ref_logits = hf_greedy(adapters[lora_id][1], prompt["prompt_token_ids"], 10)
            assert_greedy_matches(list(out.outputs[0].token_ids), ref, ref_logits, f"tp{tp} adapter {lora_id}")
            changed += lora_id is not None and ref != hf_greedy(adapters[None][1], prompt["prompt_token_ids"], 10)[0]
        assert changed >= 2, "the adapters hardly change the base model's tokens: the test would not see them"
        stats = lora_engine(tp).stats()
        assert stats["num_free_blocks"] == stats["num_blocks"], stats

    # (linear path, leaf) -> the axis of the stacked leaf [L, slots, ...] split over the model axis (None: whole)
    LORA_SPLITS = {(("attn", "qkv"), "lora_a"): None, (("attn", "qkv"), "lora_b"): 3,  # [L, S, R, kv, G + 2, hd]
                   (("mlp", "gate_up"), "lora_a"): None, (("mlp", "gate_up"), "lora_b"): 4,  # [L, S, R, 2, F]
                   (("attn", "o"), "lora_a"): 2, (("attn", "o"), "lora_b"): None,  # A [L, S, heads, hd, R]
                   (("mlp", "down"), "lora_a"): 2, (("mlp", "down"), "lora_b"): None}  # A [L, S, F, R]

    @pytest.mark.parametrize("tp", [2, 8])
    def test_each_device_holds_its_share_of_the_lora_slots(tp):
        """Column-parallel q/k/v and gate/up: A whole on every device, B split on its output axis as the kernel
        is; row-parallel o and down: A split on its input axis, B whole. The slot write sends each device its
        part and gathers nothing (no collective in its program); the written slot holds the adapter."""
        from jaxpage.lora.worker_manager import SlotWriter

        runner = lora_engine(tp).engine.runner
        assert runner.config.model.num_kv_head_replicas == (2 if tp == 8 else 1)
        layers = runner.params["layers"]
        for (linear, leaf), axis in LORA_SPLITS.items():
            array = layers[linear[0]][linear[1]][leaf]
            expected = list(array.shape)
            if axis is not None:
                expected[axis] //= tp
            shards = array.addressable_shards
            assert len({s.device for s in shards}) == tp
            assert all(list(s.data.shape) == expected for s in shards), (linear, leaf, array.sharding)
        writer = SlotWriter(runner.params)
        request = lora_adapters()[2][0]
        adapter = runner.lora.get(request)
        hlo = writer.lower(runner.params, 1, adapter).compile().as_text()
        assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter", hlo)
        written = writer.write(runner.params, 1, adapter)["layers"]
        for path, value in adapter.weights.items():
            array = written[path[0]][path[1]][path[2]]
            for s in array.addressable_shards:  # each device's part of slot 1 is its part of the adapter
                index = (s.index[0], *s.index[2:])
                np.testing.assert_array_equal(np.asarray(s.data)[:, 1], value[index])

    def test_tp4_step_with_the_triton_kernel_lowers_for_cuda():
        """The CUDA lane at TP 4 (Llama-3-8B's shapes, attention_backend="pallas_gpu"): the step lowers for four
        GPUs with its one Triton attention call inside the shard_map and the layers' all-reduces."""
        from jaxpage.testing.cuda_lowering import TRITON_CALL, lower_for_cuda, tp_step_case

        text = lower_for_cuda(tp_step_case(4))
        assert text.count(f"@{TRITON_CALL}") == 1, "the scanned layer holds one Triton attention call"
        assert "num_partitions = 4" in text and "all_reduce" in text

    def test_tp3_lora_step_lowers_for_cuda():
        """The CUDA lane's multi-LoRA step at TP 3 (SmolLM2's shapes, 4 slots of rank 16): it lowers for three
        GPUs with its one Triton call and the layers' all-reduces."""
        from jaxpage.testing.cuda_lowering import TRITON_CALL, lora_step_case, lower_for_cuda

        text = lower_for_cuda(lora_step_case(3))
        assert text.count(f"@{TRITON_CALL}") == 1
        assert "num_partitions = 3" in text and "all_reduce" in text

    def test_sizes_that_cannot_work_are_refused_by_name():
        with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's num_attention_heads=8"):
            LLM(model=model_dir("llama-8h-4kv"), tensor_parallel_size=3, **OPTIONS)
        with pytest.raises(ValueError, match="tensor_parallel_size=9 exceeds the 8 devices available"):
            LLM(tensor_parallel_size=9, **SMOLLM2_OPTIONS)  # 9 heads, 3 KV heads: only the devices are short

    def test_kv_heads_that_neither_divide_nor_are_divided_are_refused_by_name():
        import dataclasses

        from jaxpage.distributed.parallel import check_tensor_parallel

        model = dataclasses.replace(engine("llama-8h-4kv", 2, "xla").engine.config.model, num_heads=12,
                                    num_kv_heads=8)
        with pytest.raises(ValueError, match="tensor_parallel_size=6 must divide the model's num_key_value_heads=8"):
            check_tensor_parallel(model, 6)
