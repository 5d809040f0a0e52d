"""jaxpage.testing.step_model's analytical counts against independent arithmetic (no compile)."""
import dataclasses
import math

import jax
import pytest

from jaxpage.testing import compile_targets, step_model
from jaxpage.testing.step_model import CHIPS, KVLayout, Seq

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def config():
    """SmolLM2's engine with 2 layers: head_dim 64, 3 KV heads, block 16, bfloat16, the packed pool."""
    return compile_targets.engine_config("smollm2-135m", num_layers=2)


def test_weights_are_the_leaves_bytes(config):
    from jaxpage.models import abstract_params

    leaves = jax.tree.leaves(abstract_params(config.step_model, config.dtype))
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


def _gpu_layout(head_dim=64):
    model = dataclasses.replace(compile_targets.smollm2_config(), num_layers=1, num_kv_heads=2, head_dim=head_dim)
    config = compile_targets.engine_config("smollm2-135m", num_layers=1)
    return KVLayout.gpu(dataclasses.replace(config, model=model))


def test_gpu_pool_is_unpadded():
    layout = _gpu_layout(64)
    assert layout.token_bytes == 2 * 2 * 64 * 2  # K and V x 2 KV heads x 64 x bfloat16
    assert layout.page_bytes == 16 * layout.token_bytes  # no lanes padding to 128, unlike _layout(64, False)
    assert _layout(64, False).page_bytes == 2 * layout.page_bytes


def test_gpu_blocking(config):
    assert step_model.gpu_blocking(config) == (16, 4)  # G = 3 padded to 4: 64 // 4 queries; 64 keys / block 16
    model = dataclasses.replace(config.model, num_heads=8, num_kv_heads=1)
    assert step_model.gpu_blocking(dataclasses.replace(config, model=model)) == (8, 4)


def test_gpu_plan_by_hand():
    layout = _gpu_layout()
    tokens = lambda n: n * layout.token_bytes  # noqa: E731
    plan = lambda seqs: step_model.ragged_gpu_kernel_bytes(layout, seqs, 16, 4)  # noqa: E731
    # decode at 65: keys 0..63 are 4 pages, one chunk of 4; the new key comes in a chunk of 16 input rows
    assert plan([Seq(65, 1)]) == (tokens(64 + 16), tokens(1))
    # decode at 66: keys 0..64 need 5 pages: two chunks, 8 pages
    assert plan([Seq(66, 1)]) == (tokens(128 + 16), tokens(1))
    # a 64-token prompt: 4 query blocks, no pool page; block b loads new-key chunks 0..b
    assert plan([Seq(64, 64)]) == (tokens((1 + 2 + 3 + 4) * 16), tokens(64))
    # 20 new tokens after 80: blocks of 16 and 4 tokens each load 8 pages; new keys 1 chunk, then 2
    assert plan([Seq(100, 20)]) == (tokens(2 * 128 + 16 + 32), tokens(20))


def test_gpu_plan_against_the_kernels_blocking():
    """The same count from ragged_gpu.query_blocks on the flat batch, program by program."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.ragged_attention.gpu import query_blocks

    layout, queries, pages = _gpu_layout(), 16, 4
    seqs = [Seq(40, 1), Seq(300, 1), Seq(100, 37), Seq(17, 17), Seq(33, 1)]
    token_seq = np.array([i for i, s in enumerate(seqs) for _ in range(s.new)], np.int32)
    positions = np.array([p for s in seqs for p in range(s.length - s.new, s.length)])
    max_blocks = min(len(token_seq), -(-len(token_seq) // queries) + len(seqs) + 1)
    run_start, first, count = map(np.asarray, query_blocks(jnp.asarray(token_seq), queries, max_blocks))
    keys = 0
    for f, c in zip(first, count):
        if c == 0:
            continue
        start, start_pos = run_start[f], positions[run_start[f]]
        keys += -(-(-(-start_pos // 16)) // pages) * pages * 16 + -(-(f + c - start) // 16) * 16
    read, written = step_model.ragged_gpu_kernel_bytes(layout, seqs, queries, pages)
    assert (read, written) == (keys * layout.token_bytes, len(token_seq) * layout.token_bytes)


def test_gpu_plan_moves_at_least_what_is_needed():
    layout = _gpu_layout()
    for length in range(1, 300, 7):
        for new in (1, 5, 16, 17, 40):
            seqs = [Seq(max(length, new), new)]
            read, written = step_model.ragged_gpu_kernel_bytes(layout, seqs, 16, 4)
            needed_read, needed_write = step_model.kv_bytes_needed(layout, seqs)
            assert read >= needed_read and written == needed_write
            if new == 1:  # a decode never matches: 15 spare input rows, and up to 63 keys of a 4-page chunk
                assert 15 <= (read - needed_read) // layout.token_bytes <= 15 + 63


def test_gpu_row(config):
    row = step_model.model_step("smollm2-135m", CHIPS["H100"], 8, 1024, config)
    assert row.old_kv_ratio is None and row.kernel_write_bytes == row.kv_write_bytes
    assert row.read_ratio == pytest.approx(1024 / (1024 + 16))  # 64 pages of the pool and 16 input rows per decode
    assert 0 < row.step_ratio < 1 and step_model.table_line(row).split(" | ")[12] == "-"  # the old design's column
