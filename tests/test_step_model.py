"""benchmarks.step_model's analytical counts against independent arithmetic (no compile)."""
import dataclasses
import math

import jax
import pytest

from benchmarks import compile_targets, step_model
from benchmarks.step_model import CHIPS, KVLayout, Seq

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def config():
    """SmolLM2's engine with 2 layers: head_dim 64, 3 KV heads, block 16, bfloat16, the packed pool."""
    return compile_targets.engine_config("smollm2-135m", num_layers=2)


def test_weights_are_the_leaves_bytes(config):
    from jaxpage.models import abstract_params

    leaves = jax.tree.leaves(abstract_params(config.model, config.dtype))
    assert config.model.tie_word_embeddings  # the whole embedding is read as the LM head
    assert step_model.weight_count(config, 8).bytes == sum(math.prod(a.shape) * 2 for a in leaves)


def test_decode_kv_read_and_write(config):
    rows, context = 8, 320  # page-aligned
    seqs = step_model.step_batch(config, rows, context)
    assert seqs == [Seq(context, 1)] * rows
    read, written = step_model.kv_bytes_needed(KVLayout.of(config), seqs)
    assert read == rows * context * 2 * 2 * 3 * 64 * 2  # rows x context x layers x (K, V) x kv_heads x d x bf16
    assert written == rows * 2 * 2 * 3 * 64 * 2


def test_mixed_bucket_fills_the_tokens(config):
    seqs = step_model.step_batch(config, 128, 1024)
    assert len(seqs) == 64 and sum(s.new for s in seqs) == 128 and seqs[-1] == Seq(1024, 65)


def _layout(head_dim, packed):
    model = dataclasses.replace(compile_targets.smollm2_config(), num_layers=1, num_kv_heads=2, head_dim=head_dim)
    config = compile_targets.engine_config("smollm2-135m", num_layers=1)
    return KVLayout.of(dataclasses.replace(config, model=model), packed=packed)


def test_dma_plan_ratio():
    seqs = [Seq(256, 1)] * 16  # page-aligned decodes
    for head_dim, packed, read_ratio in ((128, False, 1.0), (64, True, 1.0), (64, False, 0.5)):
        layout = _layout(head_dim, packed)
        needed_read, needed_write = step_model.kv_bytes_needed(layout, seqs)
        read, written = step_model.ragged_kernel_bytes(layout, seqs)
        assert needed_read / read == read_ratio
        # one bfloat16 tile of 16 rows (the whole page at block 16) written per decode token
        assert written == 16 * layout.page_bytes
        assert needed_write / written == (1 / 16) * read_ratio


def test_prompt_chunk_rereads_per_query_block():
    layout = _layout(128, False)
    read, written = step_model.ragged_kernel_bytes(layout, [Seq(64, 64)])  # one 64-token prompt: 4 query blocks
    assert read == (1 + 2 + 3 + 4) * layout.page_bytes and written == 4 * layout.page_bytes


def test_old_design_reads_a_tile_per_token():
    layout = _layout(128, False)
    seqs = [Seq(256, 1)] * 16
    read, written = step_model.two_kernel_bytes(layout, seqs)
    new_read, new_written = step_model.ragged_kernel_bytes(layout, seqs)
    assert read == new_read + 16 * layout.page_bytes and written == new_written


def test_bound_is_the_larger_of_memory_and_compute(config):
    row = step_model.model_step("smollm2-135m", CHIPS["v5e"], 8, 1024, config)
    memory_s = row.needed_bytes / 819e9
    assert row.bound_s == pytest.approx(max(memory_s, row.flops / 197e12)) and row.bound_by == "memory"
    assert 0 < row.kv_ratio < row.read_ratio <= 1 and row.old_kv_ratio < row.kv_ratio


def test_flop_and_activation_counts(config):
    weights = step_model.weight_count(config, 8)
    # per layer: qkv 576 x (9 + 2 x 3) x 64, o 9 x 64 x 576, gate_up 576 x 2 x 1536, down 1536 x 576
    assert weights.decoder_params == 2 * (576 * 15 * 64 + 9 * 64 * 576 + 576 * 2 * 1536 + 1536 * 576)
    assert weights.head_params == 49152 * 576
    # between matmuls, per token and layer: 576 + 960 + 576 + 576 + 3072 + 1536 + 576 = 7872 values
    assert step_model.activation_bytes(config, 8, 8) == 2 * (8 * 7872 * 2 * 2 + 8 * 49152 * 4)
    row = step_model.model_step("smollm2-135m", CHIPS["v5e"], 8, 64, config)
    attention = 4 * 9 * 64 * 8 * 64 * 2  # 8 decodes seeing 64 keys, 2 layers
    assert row.flops == 2 * weights.decoder_params * 8 + 2 * weights.head_params * 8 + attention
