"""Paged attention over the flat batch, through block tables: the backend choice and the XLA reference path."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cpu_kernels import kv_write
from jaxpage.attention.kv_cache import write_kv
from jaxpage.distributed.parallel import model_axis_size, over_heads
from pallas_kernels.quant import dequantize, pool_parts
from pallas_kernels.reference import soft_cap_logits, window_start

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

    Every backend has these semantics (pallas_kernels.reference.ragged_paged_attention_reference). A step
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
        pool = _write_kv_for_platform(pool, layer, k, v, slot_mapping)
        return paged_attention_xla(q, pool, layer, token_seq, positions, block_tables, scale, pairs,
                                   window=window, soft_cap=soft_cap), pool
    import pallas_kernels

    kernel = {"pallas_gpu": pallas_kernels.ragged_paged_attention_gpu,
              "pallas_tpu": pallas_kernels.ragged_paged_attention_tpu}[backend]
    kernel = functools.partial(kernel, scale=scale, soft_cap=soft_cap, window=jnp.asarray(window, jnp.int32))
    return jax.lax.platform_dependent(  # the kernel mode follows the platform the step is lowered for
        q, k.astype(q.dtype), v.astype(q.dtype), pool, layer, token_seq, positions, slot_mapping, block_tables,
        cpu=functools.partial(kernel, interpret=True), default=functools.partial(kernel, interpret=False))


def _write_kv_for_platform(pool, layer, k, v, slot_mapping):
    """XLA's scatter, but on a TPU the K/V write kernel: XLA:TPU relayouts the whole pool around a scatter."""
    from pallas_kernels import write_kv_tpu
    from pallas_kernels.kv_write_tpu import tile_rows

    if pool.shape[4] % tile_rows(pool.dtype):  # not lowerable for a TPU (build_engine_config refuses it there)
        return write_kv(pool, layer, k, v, slot_mapping)
    return jax.lax.platform_dependent(pool, layer, k, v, slot_mapping, tpu=write_kv_tpu, default=write_kv)


_MASKED = -1e30
PAIRS_PER_CHUNK = 64  # (query group, page) pairs read per loop iteration: 1.5 MiB of float32 K/V for SmolLM2
QUERY_TILE = 16  # a prompt chunk's query tokens attended together, so that each of their pages is read once


@dataclasses.dataclass(frozen=True)
class PairList:
    """The ragged list of (query group, page) pairs one loop of the XLA attention walks: group g (up to Q
    consecutive query tokens of one sequence, from ``first[g]``, ``length[g]`` of them, 0 for none) owns its
    pages from the one holding its window's first key to its last token's, in group order; padded to a static
    bound plus a chunk of slack.

    group: each pair's group; page: its index in the group's block-table row; block: the physical block (0 past
    the end); valid: inside the real list; num_chunks: chunks of the loop's pairs to walk."""

    first: jax.Array
    length: jax.Array
    group: jax.Array
    page: jax.Array
    block: jax.Array
    valid: jax.Array
    num_chunks: jax.Array


@dataclasses.dataclass(frozen=True)
class PagePairs:
    """The step's plan for the XLA attention: single query tokens (decodes) read their pages one token a pair;
    tokens of a prompt chunk go in tiles of QUERY_TILE that read each page once for the whole tile (a 64-token
    chunk at a 1,000-token context otherwise gathers every page 64 times). tile_of: each token's tile (-1:
    a single token)."""

    singles: PairList
    tiles: PairList
    tile_of: jax.Array

    @property
    def num_chunks(self) -> jax.Array:
        return self.singles.num_chunks + self.tiles.num_chunks


for _cls in (PairList, PagePairs):
    jax.tree_util.register_dataclass(_cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])


def _pair_list(first, length, positions, token_seq, block_tables, block_size: int, window, chunk: int) -> PairList:
    """The pairs of groups (first, length) whose tokens have consecutive positions (see PairList)."""
    width, num_tokens = block_tables.shape[1], positions.shape[0]
    last = jnp.clip(first + length - 1, 0, num_tokens - 1)
    start = jnp.clip(first, 0, num_tokens - 1)
    first_page = window_start(positions[start], window) // block_size
    num_pages = jnp.where(length > 0, positions[last] // block_size + 1 - first_page, 0)
    ends = jnp.cumsum(num_pages)
    pair = jnp.arange(first.shape[0] * width + chunk)  # static bound on the pairs, plus a chunk of slack
    group = jnp.minimum(jnp.searchsorted(ends, pair, side="right"), first.shape[0] - 1).astype(jnp.int32)
    page = jnp.clip(pair - (ends - num_pages)[group] + first_page[group], 0, width - 1)
    valid = pair < ends[-1]
    block = jnp.where(valid, block_tables[token_seq[start[group]], page], 0)
    return PairList(first, length, group, page, block, valid, (ends[-1] + chunk - 1) // chunk)


def page_pairs(token_seq: jax.Array, positions: jax.Array, block_tables: jax.Array, block_size: int,
               window=0) -> PagePairs:
    """The step's attention plan for the XLA path: the same for every layer of one window, so the model makes
    it once per window (``page_pairs_by_window`` for several, ``select_pairs`` to pick a layer's). A run is a
    sequence's tokens at consecutive positions (padding tokens, all at position 0, are runs of one)."""
    token_seq, positions, block_tables = (jnp.asarray(a) for a in (token_seq, positions, block_tables))
    num_tokens, num_rows = positions.shape[0], block_tables.shape[0]
    index = jnp.arange(num_tokens, dtype=jnp.int32)
    joined = jnp.concatenate([jnp.zeros(1, bool), (token_seq[1:] == token_seq[:-1])
                              & (positions[1:] == positions[:-1] + 1)])
    run_start = jax.lax.cummax(jnp.where(joined, 0, index))
    ends_run = jnp.concatenate([~joined[1:], jnp.ones(1, bool)])
    run_end = jax.lax.cummin(jnp.where(ends_run, index, num_tokens - 1), reverse=True)
    single = run_start == run_end
    tile_starts = ~single & ((index - run_start) % QUERY_TILE == 0)
    num_tiles = max(1, num_tokens // QUERY_TILE + min(num_rows, num_tokens // 2))  # static bound on the tiles
    first = jnp.nonzero(tile_starts, size=num_tiles, fill_value=num_tokens)[0].astype(jnp.int32)
    length = jnp.where(first < num_tokens, jnp.minimum(QUERY_TILE, run_end[jnp.minimum(first, num_tokens - 1)]
                                                        - first + 1), 0)
    tile_of = jnp.where(single, -1, jnp.cumsum(tile_starts) - 1).astype(jnp.int32)
    plan = functools.partial(_pair_list, positions=positions, token_seq=token_seq, block_tables=block_tables,
                             block_size=block_size, window=window)
    return PagePairs(plan(index, single.astype(jnp.int32), chunk=PAIRS_PER_CHUNK),
                     plan(first, length, chunk=_tile_chunk()), tile_of)


def _tile_chunk() -> int:
    """(tile, page) pairs per loop iteration: a tile's pair does QUERY_TILE tokens' work."""
    return max(1, PAIRS_PER_CHUNK // 4)


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

    if not (kv_write.needs_kernel(pages.dtype) and kv_write.available()):
        return take(pages, rows)
    return jax.lax.platform_dependent(pages, rows, cpu=kv_write.gather_rows, default=take)


def paged_attention_xla(q: jax.Array, pool: jax.Array, layer: jax.Array, token_seq: jax.Array,
                        positions: jax.Array, block_tables: jax.Array, scale: float,
                        pairs: PagePairs | None = None, window=0, soft_cap: float | None = None) -> jax.Array:
    """Causal attention of each query token over its own sequence's pages (split-K over pages, XLA ops only).

    q: ``[T, num_heads, head_dim]``; pool: the whole KV pool (see jaxpage.attention.kv_cache), already holding this step's
    K/V, read at ``layer`` page by page (never sliced whole, which would copy a layer per call); token_seq: ``[T]``,
    the row of ``block_tables`` ``[S, W]`` that each token belongs to; positions: ``[T]``. Token t attends to key
    positions ``<= positions[t]`` and, with ``window`` W > 0 (an int32 scalar, traced or not), ``> positions[t] - W``;
    logits are soft-capped when ``soft_cap`` is set. ``pairs`` must be a plan for the same window. Returns ``[T, num_heads, head_dim]`` in q's dtype.

    The work is the ragged list of (query group, page) pairs (``page_pairs``; pass it to share it between
    layers), walked in chunks up to its real length (a dynamic trip count): the cost is the sum of the tokens'
    contexts, not the number of tokens times the longest context, and a prompt chunk's tiles read each page once.
    Each chunk gathers its pages as rows of the flat pool, computes per-pair softmax partials and merges them
    into the groups' running (max, sum, output) with segment reductions (pairs of one group are contiguous).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_layers, num_blocks, _, kv_heads, block_size, _ = pool.shape
    positions = jnp.asarray(positions)
    if pairs is None:
        pairs = page_pairs(token_seq, positions, block_tables, block_size, window)
    values, scales = pool_parts(pool)
    pages = _FlatPages(values.reshape(num_layers * num_blocks, 2, kv_heads, block_size, head_dim),
                       None if scales is None else scales.reshape(num_layers * num_blocks, 2, kv_heads, block_size),
                       layer * num_blocks)
    q_g = q.reshape(num_tokens, kv_heads, num_heads // kv_heads, head_dim).astype(jnp.float32) * scale
    attend = functools.partial(_attend_groups, q_g, positions, pages, window=window, soft_cap=soft_cap)
    singles = attend(pairs.singles, 1, PAIRS_PER_CHUNK)[:, 0]

    def with_tiles():
        tiles = attend(pairs.tiles, QUERY_TILE, _tile_chunk())
        tile = jnp.maximum(pairs.tile_of, 0)
        in_tile = jnp.clip(jnp.arange(num_tokens) - pairs.tiles.first[tile], 0, QUERY_TILE - 1)
        return jnp.where((pairs.tile_of >= 0)[:, None, None, None], tiles[tile, in_tile], singles)

    out = jax.lax.cond(pairs.tiles.num_chunks > 0, with_tiles, lambda: singles)  # decode steps have no tiles
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class _FlatPages:
    """The pool as rows of pages (every layer's), their scales (quantized pools) and the layer's first row."""
    values: jax.Array
    scales: jax.Array | None
    offset: jax.Array


def _attend_groups(q_g: jax.Array, positions: jax.Array, pages: _FlatPages, plan: PairList, width: int,
                   chunk: int, window, soft_cap: float | None) -> jax.Array:
    """Attention of each group of ``plan`` (up to ``width`` query tokens) over its pages: [G, width, kvh, g, hd],
    float32; rows past a group's length are garbage."""
    num_tokens, kv_heads, group, head_dim = q_g.shape
    block_size = pages.values.shape[3]
    num_groups = plan.first.shape[0]
    rows = plan.block + pages.offset

    def body(c, carry):
        m, l, acc = carry
        row, grp, page, valid = (jax.lax.dynamic_slice_in_dim(a, c * chunk, chunk)
                                 for a in (rows, plan.group, plan.page, plan.valid))
        kv = dequantize(take_pages(pages.values, row),  # [C, 2, kvh, bs, hd]
                        None if pages.scales is None else jnp.take(pages.scales, row, axis=0, mode="clip"),
                        jnp.float32)
        offset = jnp.arange(width)
        tok = jnp.clip(plan.first[grp][:, None] + offset, 0, num_tokens - 1)  # [C, width]
        scores = soft_cap_logits(_dot_keys(q_g, tok, kv[:, 0]), soft_cap)
        key_pos = (page[:, None] * block_size + jnp.arange(block_size))[:, None, :]
        pos = positions[tok][..., None]
        live = valid[:, None] & (offset < plan.length[grp][:, None])
        visible = ((key_pos <= pos) & (key_pos >= window_start(pos, window)) & live[..., None])[:, :, None, None]
        scores = jnp.where(visible, scores, _MASKED)
        m_pair = scores.max(axis=-1)
        p = jnp.where(visible, jnp.exp(scores - m_pair[..., None]), 0.0)
        segment = dict(segment_ids=grp, num_segments=num_groups, indices_are_sorted=True)
        m_new = jnp.maximum(m, jax.ops.segment_max(m_pair, **segment))
        weight = jnp.exp(m_pair - m_new[grp])
        correction = jnp.exp(m - m_new)
        l = l * correction + jax.ops.segment_sum(p.sum(axis=-1) * weight, **segment)
        pv = _dot_values(p, kv[:, 1]) * weight[..., None]
        acc = acc * correction[..., None] + jax.ops.segment_sum(pv, **segment)
        return m_new, l, acc

    shape = (num_groups, width, kv_heads, group)
    init = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, plan.num_chunks, body, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def _dot_keys(q_g: jax.Array, tok: jax.Array, keys: jax.Array) -> jax.Array:
    """Scores [C, width, kvh, g, bs] of the pairs' query tokens ``tok`` [C, width] against their pages' keys; one
    query a pair (decodes) without the unit axis in the dot, which XLA:CPU lays out worse."""
    if tok.shape[1] == 1:
        return jnp.einsum("ckgd,ckbd->ckgb", q_g[tok[:, 0]], keys)[:, None]
    return jnp.einsum("cqkgd,ckbd->cqkgb", q_g[tok], keys)


def _dot_values(p: jax.Array, values: jax.Array) -> jax.Array:
    """The pairs' probabilities [C, width, kvh, g, bs] times their pages' values: [C, width, kvh, g, hd]."""
    if p.shape[1] == 1:
        return jnp.einsum("ckgb,ckbd->ckgd", p[:, 0], values)[:, None]
    return jnp.einsum("cqkgb,ckbd->cqkgd", p, values)
