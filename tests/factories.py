"""What the tests build again and again: engine options, small random models (a tiny Llama, one model per
architecture case), the real model's options, and child processes (forced CPU devices, no torch)."""
from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

# Every run draws a fresh seed for the random models (set JAXPAGE_TEST_SEED to replay one).
SEED = int(os.environ.get("JAXPAGE_TEST_SEED") or random.randrange(2**31))

# The engine of the tests' small random models; each test file states what it changes.
SMALL_ENGINE = dict(block_size=16, num_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                    dtype="float32", progress=False)
SMOLLM2_OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, dtype="float32",
                       kv_cache_memory=256 << 20, progress=False)

TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
# 8 query and 4 KV heads of 16: they divide tensor-parallel sizes 2 and 4
EIGHT_HEADS = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, tie_word_embeddings=False,
                   rms_norm_eps=1e-5)

# A child script's first line: every `import torch` fails, as on a machine without torch.
WITHOUT_TORCH = 'import sys; sys.modules["torch"] = None\n'


_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=128)
# Every architecture of the model layer but Llama (tiny_llama), tiny and random: transformers' config class name ->
# (its arguments, whether its MLP is Linears: False for the MoE models, whose experts are not)
ARCHITECTURES = {
    "Qwen3Config": (dict(_TINY, intermediate_size=128, attention_bias=True, tie_word_embeddings=True), True),
    "Qwen2Config": (dict(_TINY, intermediate_size=128, tie_word_embeddings=False), True),
    "Gemma2Config": (dict(_TINY, intermediate_size=128, query_pre_attn_scalar=24, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=5.0,
                          final_logit_softcapping=20.0, tie_word_embeddings=True), True),
    "Gemma3TextConfig": (dict(_TINY, intermediate_size=96, num_key_value_heads=1, query_pre_attn_scalar=48,
                              sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                              tie_word_embeddings=False), True),
    "MixtralConfig": (dict(_TINY, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=None, tie_word_embeddings=False), False),
    "Qwen3MoeConfig": (dict(_TINY, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True), False),
}


def engine_options(**changes) -> dict:
    return {**SMALL_ENGINE, **changes}


def tiny_llama(**changes):
    """transformers' LlamaConfig of a 2-layer model with 4 heads (2 KV heads) and a vocabulary of 256."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **changes})


def tiny_llm(tmp_path_factory, **options):
    """An LLM over a tiny Llama of fresh random weights: 8 sequences of up to 128 tokens, 32 batched tokens."""
    from jaxpage import LLM
    from tests.reference import save_random_model

    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(tiny_llama(), path, seed=random.randrange(2**31))
    return LLM(str(path), cache_dir=str(tmp_path_factory.mktemp("cache")),
               **engine_options(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, **options))


def save_word_tokenizer(path, vocab_size: int) -> None:
    """A tokenizer of words ``t0`` ... ``t<vocab_size - 1>`` (word i is token i) and a chat template that writes
    the messages' contents one after another, saved beside a tiny model: text prompts and chats that a random
    model's vocabulary can take."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)


@dataclasses.dataclass(frozen=True)
class Case:
    """One architecture's small random model: transformers' config class and its arguments."""
    id: str
    config_cls: type
    kwargs: dict
    pallas_backend: str = ""  # the Pallas backend it is also run on
    gguf_arch: str = ""  # llama.cpp's architecture name, for its GGUF file


@dataclasses.dataclass
class RandomModel:
    case: Case
    seed: int
    hf: object  # the transformers model (torch.nn.Module), float32, eval mode
    hf_dir: Path

    def random_prompt(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, self.hf.config.vocab_size, n)]


def random_model(cases: list[Case], case: Case, tmp_path_factory) -> RandomModel:
    """``case``'s model with random weights, saved as a Hugging Face directory; seeded by SEED and its place in
    ``cases``, so each case has its own weights and a failure replays with JAXPAGE_TEST_SEED."""
    from tests.reference import save_random_model

    seed = (SEED + 7919 * cases.index(case)) % 2**31
    hf_dir = tmp_path_factory.mktemp(case.id)
    return RandomModel(case, seed, save_random_model(case.config_cls(**case.kwargs), hf_dir, seed), hf_dir)


def run_on_forced_devices(test_file: str, num_devices: int, child_flag: str) -> None:
    """Runs ``test_file``'s tests (or one of them: ``"<file>::<test>"``) in a child pytest on ``num_devices``
    forced CPU devices (XLA reads the count once, when it starts), with the environment variable ``child_flag``
    set to 1; fails with the child's output."""
    env = {**os.environ, child_flag: "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
                         cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"child pytest failed:\n{run.stdout[-8000:]}\n{run.stderr[-4000:]}"
