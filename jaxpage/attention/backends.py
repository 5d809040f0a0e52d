"""Paged attention over the flat batch, through block tables: the backend choice and the XLA reference path."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxpage.cpu_kernels import kv_write
from jaxpage.cpu_kernels import paged_attention as cpu_attention
from jaxpage.attention.kv_write import write_kv
from jaxpage.distributed.parallel import model_axis_size, over_heads
from pallas_kernels.quant import dequantize, pool_parts
from pallas_kernels.common import check_unpacked, soft_cap_logits, window_start

BACKENDS = ("auto", "xla", "pallas_gpu", "pallas_tpu")


def resolve_backend(name: str) -> str:
    """'auto' picks the Pallas kernel of the platform, and the XLA path on the CPU."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} must be one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "xla")


def write_and_attend(backend: str, q: jax.Array, k: jax.Array, v: jax.Array, pool: jax.Array, layer: jax.Array,
                     token_seq: jax.Array, positions: jax.Array, slot_mapping: jax.Array, block_tables: jax.Array,
                     scale: float, pairs: "PagePairs | None" = None, window=0,
                     soft_cap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Writes this step's K/V into the pool and attends through the block tables; returns (out, pool).

    Every backend has these semantics (pallas_kernels.ragged_attention.reference). A step
    lowered for the CPU runs the Pallas backends through the Pallas interpreter (so the whole engine can be
    exercised here); lowered for a TPU or GPU, even ahead of time from a CPU, it runs them compiled. ``pairs``:
    the XLA path's per-step plan (``page_pairs``, built for the same ``window``), made once per step rather than
    once per layer. window: an int32 scalar, traced or not (0: full causal attention); soft_cap: a static float.

    Traced under a tensor-parallel mesh (jaxpage.distributed.parallel), every device runs this on its own heads and its
    slice of the pool (``shard_map``), whichever the backend.
    """

    local = functools.partial(_write_and_attend, backend, scale=scale, soft_cap=soft_cap)
    shared = dict(layer=layer, token_seq=token_seq, positions=positions, slot_mapping=slot_mapping,
                  block_tables=block_tables, pairs=pairs, window=jnp.asarray(window, jnp.int32))
    if model_axis_size() > 1:
        return over_heads(local, q, k, v, pool, shared)
    return local(q, k, v, pool, **shared)


def _write_and_attend(backend: str, q: jax.Array, k: jax.Array, v: jax.Array, pool: jax.Array, layer: jax.Array,
                      token_seq: jax.Array, positions: jax.Array, slot_mapping: jax.Array, block_tables: jax.Array,
                      scale: float, pairs: "PagePairs | None" = None, window=0,
                      soft_cap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """write_and_attend on the heads and the slice of the pool that one device holds."""
    if backend == "xla":
        check_unpacked(pool, "the XLA attention path")
        pool = write_kv(pool, layer, k, v, slot_mapping)
        return _attend_for_platform(q, pool, layer, token_seq, positions, block_tables, scale, pairs, window,
                                    soft_cap), pool
    import pallas_kernels

    kernel = {"pallas_gpu": pallas_kernels.ragged_paged_attention_gpu,
              "pallas_tpu": pallas_kernels.ragged_paged_attention_tpu}[backend]
    kernel = functools.partial(kernel, scale=scale, soft_cap=soft_cap, window=jnp.asarray(window, jnp.int32))
    return jax.lax.platform_dependent(  # the kernel mode follows the platform the step is lowered for
        q, k.astype(q.dtype), v.astype(q.dtype), pool, layer, token_seq, positions, slot_mapping, block_tables,
        cpu=functools.partial(kernel, interpret=True), default=functools.partial(kernel, interpret=False))


def _attend_for_platform(q, pool, layer, token_seq, positions, block_tables, scale, pairs, window, soft_cap):
    """The XLA path's attention; on a CPU with the CPU kernels built, their FFI kernel, which reads the pool in
    place (XLA's ops gather every page they read and run on one thread)."""
    xla = functools.partial(paged_attention_xla, scale=scale, pairs=pairs, window=window, soft_cap=soft_cap)
    return cpu_attention.PAGED_ATTENTION(xla, q, pool, layer, token_seq, positions, block_tables, scale=scale,
                                         window=window, soft_cap=soft_cap)


_MASKED = -1e30
PAIRS_PER_CHUNK = 64  # most (tile, page) pairs read per loop iteration: 1.5 MiB of float32 K/V for SmolLM2
QUERY_TILE = 16  # query tokens of one sequence that share each page read, in steps with prompt chunks


def query_tile(num_tokens: int, num_seqs: int) -> int:
    """Tokens per query tile for a step of ``num_tokens`` slots and ``num_seqs`` block-table rows: QUERY_TILE in
    the buckets with more slots than rows (they carry prompt chunks), one where a step of decodes alone fits (a
    tile's other rows would be other sequences', computed for nothing)."""
    return QUERY_TILE if num_tokens > num_seqs else 1


def pairs_per_chunk(num_tokens: int) -> int:
    """Pairs a loop iteration reads: fewer for few tokens (one stream's dozen pages would otherwise fill a
    chunk of 64 with padding that is gathered and computed all the same)."""
    return min(PAIRS_PER_CHUNK, 16 * num_tokens)


@dataclasses.dataclass(frozen=True)
class PagePairs:
    """The ragged list of (tile, page) pairs the XLA attention walks. The step's tokens are cut into query tiles
    of ``query_tile(T, S)`` slots (tile i holds tokens i*Q .. i*Q+Q-1); the tokens of one sequence inside one tile
    (a sub-tile) own the pages from the one holding their window's first key to their last position's, and
    every such page is one pair, read once for all of them. Pairs in token order, padded to a static
    ``T * W + pairs_per_chunk(T)`` entries.

    tile: the pair's query tile; sub: its sub-tile; page: the page's index in the sub-tile's block-table row;
    block: the physical block (0 past the end); valid: inside the real list; num_chunks: loop iterations;
    token_sub: each token's sub-tile (a tile can hold two sub-tiles of one sequence, e.g. its tokens and the
    padding that reads row 0, so a pair's rows are its sub-tile's, not its sequence's).
    """

    tile: jax.Array
    sub: jax.Array
    page: jax.Array
    block: jax.Array
    valid: jax.Array
    num_chunks: jax.Array
    token_sub: jax.Array


jax.tree_util.register_dataclass(
    PagePairs, data_fields=[f.name for f in dataclasses.fields(PagePairs)], meta_fields=[])


def _sub_tiles(token_seq, tile_size: int, first_page, last_page):
    """(each token's sub-tile; and the first token, first page, last page and existence of each of the step's
    at most T sub-tiles)."""
    index = jnp.arange(token_seq.shape[0])
    if tile_size == 1:  # every token its own sub-tile
        return index, index, first_page, last_page, jnp.ones_like(index, bool)
    sub = jnp.cumsum((index % tile_size == 0) | (token_seq != jnp.roll(token_seq, 1))) - 1
    segment = dict(segment_ids=sub, num_segments=token_seq.shape[0], indices_are_sorted=True)
    return (sub, jax.ops.segment_min(index, **segment), jax.ops.segment_min(first_page, **segment),
            jax.ops.segment_max(last_page, **segment), index <= sub[-1])


def page_pairs(token_seq: jax.Array, positions: jax.Array, block_tables: jax.Array, block_size: int,
               window=0) -> PagePairs:
    """The step's attention plan for the XLA path: the same for every layer of one window, so the model makes
    it once per window (``page_pairs_by_window`` for several, ``select_pairs`` to pick a layer's)."""
    token_seq, positions, block_tables = (jnp.asarray(a) for a in (token_seq, positions, block_tables))
    num_tokens, width = positions.shape[0], block_tables.shape[1]
    tile_size, chunk = query_tile(num_tokens, jnp.shape(block_tables)[0]), pairs_per_chunk(num_tokens)
    token_sub, first_token, first_page, last_page, exists = _sub_tiles(
        token_seq, tile_size, window_start(positions, window) // block_size, positions // block_size)
    num_pages = jnp.where(exists, last_page + 1 - first_page, 0)
    ends = jnp.cumsum(num_pages)
    pair = jnp.arange(num_tokens * width + chunk)  # static bound on the pairs, plus a chunk of slack
    owner = jnp.minimum(jnp.searchsorted(ends, pair, side="right"), num_tokens - 1).astype(jnp.int32)
    valid = pair < ends[-1]
    token = jnp.where(valid, first_token[owner], num_tokens - 1)
    seq = token_seq[token]
    page = jnp.clip(pair - (ends - num_pages)[owner] + first_page[owner], 0, width - 1)
    block = jnp.where(valid, block_tables[seq, page], 0)
    return PagePairs(token // tile_size, owner, page, block, valid, (ends[-1] + chunk - 1) // chunk, token_sub)


def page_pairs_by_window(token_seq, positions, block_tables, block_size: int, windows) -> PagePairs:
    """One plan per window of ``windows`` (int32 [K], e.g. a model's distinct layer windows), stacked on a
    leading axis; a layer takes its own with ``select_pairs``."""
    return jax.vmap(lambda w: page_pairs(token_seq, positions, block_tables, block_size, w))(
        jnp.asarray(windows, jnp.int32))


def select_pairs(plans: PagePairs, index) -> PagePairs:
    """Plan ``index`` (traced or not) of ``page_pairs_by_window``'s stack: a dynamic slice of each field."""
    return jax.tree.map(lambda a: a[index], plans)


def take_pages(pages: jax.Array, rows: jax.Array) -> jax.Array:
    """pages[rows] (clipped), with the CPU's gather kernel for a bfloat16/float8 pool (XLA:CPU would convert the
    whole pool to float32 to gather from it)."""
    def take(pages, rows):
        return jnp.take(pages, rows, axis=0, mode="clip")

    return kv_write.GATHER_ROWS(take, pages, rows)


def paged_attention_xla(q: jax.Array, pool: jax.Array, layer: jax.Array, token_seq: jax.Array,
                        positions: jax.Array, block_tables: jax.Array, scale: float,
                        pairs: PagePairs | None = None, window=0, soft_cap: float | None = None) -> jax.Array:
    """Causal attention of each query token over its own sequence's pages (split-K over pages, XLA ops only).

    q: ``[T, num_heads, head_dim]``; pool: the whole KV pool (see jaxpage.attention.kv_cache), already holding this step's
    K/V, read at ``layer`` page by page (never sliced whole, which would copy a layer per call); token_seq: ``[T]``,
    the row of ``block_tables`` ``[S, W]`` that each token belongs to; positions: ``[T]``. Token t attends to key
    positions ``<= positions[t]`` and, with ``window`` W > 0 (an int32 scalar, traced or not), ``> positions[t] - W``;
    logits are soft-capped when ``soft_cap`` is set. ``pairs`` must be a plan for the same window. Returns ``[T, num_heads, head_dim]`` in q's dtype.

    The work is the ragged list of (query tile, page) pairs (``page_pairs``; pass it to share it between layers),
    walked in chunks up to its real length (a dynamic trip count): the cost is the sum of the tiles' contexts,
    not the number of tokens times the longest context, and a prompt chunk reads each page once per tile of
    tokens, not once per token. Each chunk gathers its pages as rows of the flat pool, computes per-pair softmax
    partials for the tile's rows and merges them into the tiles' running (max, sum, output) with segment
    reductions (pairs of one tile are contiguous).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_layers, num_blocks, _, kv_heads, block_size, _ = pool.shape
    group = num_heads // kv_heads
    tile_size, chunk = query_tile(num_tokens, jnp.shape(block_tables)[0]), pairs_per_chunk(num_tokens)
    num_tiles = -(-num_tokens // tile_size)
    positions = jnp.asarray(positions)
    if pairs is None:
        pairs = page_pairs(token_seq, positions, block_tables, block_size, window)
    pair_row = pairs.block + layer * num_blocks
    values, scales = pool_parts(pool)
    pages = values.reshape(num_layers * num_blocks, 2, kv_heads, block_size, head_dim)
    page_scales = None if scales is None else scales.reshape(num_layers * num_blocks, 2, kv_heads, block_size)
    pad = num_tiles * tile_size - num_tokens  # padding rows: no sequence, so no key is visible to them
    q_t = jnp.pad(q.astype(jnp.float32) * scale, ((0, pad), (0, 0), (0, 0)))
    q_t = q_t.reshape(num_tiles, tile_size, kv_heads, group, head_dim)
    sub_t = jnp.pad(pairs.token_sub, (0, pad), constant_values=-1).reshape(num_tiles, tile_size)
    pos_t = jnp.pad(positions, (0, pad)).reshape(num_tiles, tile_size)

    def body(c, carry):
        m, l, acc = carry
        rows, tile, sub, page, valid = (jax.lax.dynamic_slice_in_dim(a, c * chunk, chunk)
                                        for a in (pair_row, pairs.tile, pairs.sub, pairs.page, pairs.valid))
        kv = dequantize(take_pages(pages, rows),  # [C, 2, kvh, bs, hd]
                        None if scales is None else jnp.take(page_scales, rows, axis=0, mode="clip"), jnp.float32)
        scores = soft_cap_logits(jnp.einsum("cqkgd,ckbd->cqkgb", q_t[tile], kv[:, 0]), soft_cap)
        key_pos = (page[:, None] * block_size + jnp.arange(block_size))[:, None, :]  # [C, 1, bs]
        pos = pos_t[tile][..., None]  # [C, Q, 1]
        mine = (sub_t[tile] == sub[:, None]) & valid[:, None]
        visible = (key_pos <= pos) & (key_pos >= window_start(pos, window)) & mine[..., None]
        visible = visible[:, :, None, None, :]
        scores = jnp.where(visible, scores, _MASKED)
        m_pair = scores.max(axis=-1)
        p = jnp.where(visible, jnp.exp(scores - m_pair[..., None]), 0.0)
        segment = dict(segment_ids=tile, num_segments=num_tiles, indices_are_sorted=True)
        m_new = jnp.maximum(m, jax.ops.segment_max(m_pair, **segment))
        weight = jnp.exp(m_pair - m_new[tile])
        correction = jnp.exp(m - m_new)
        l = l * correction + jax.ops.segment_sum(p.sum(axis=-1) * weight, **segment)
        pv = jnp.einsum("cqkgb,ckbd->cqkgd", p, kv[:, 1]) * weight[..., None]
        acc = acc * correction[..., None] + jax.ops.segment_sum(pv, **segment)
        return m_new, l, acc

    stats = (num_tiles, tile_size, kv_heads, group)
    init = (jnp.full(stats, _MASKED, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros(stats + (head_dim,), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, pairs.num_chunks, body, init)
    out = (acc / jnp.maximum(l, 1e-30)[..., None]).reshape(num_tiles * tile_size, num_heads, head_dim)
    return out[:num_tokens].astype(q.dtype)
