"""A step-time model per chip: the bytes and FLOPs an engine step must move, the chip's roofline lower bound on
its time, and how close the attention kernel's plan comes to the bytes it needs (issue 24, item 4).

    python -m jaxpage.testing.step_model [--chips v5e v6e v5p A100 H100 H200] [--models smollm2-135m llama-3-8b]
                                    [--context 1024] [--buckets 8 64 512] [--no-compile] [--json out.json]

For each engine step bucket (``compile_targets.engine_config``: block 16, 64 sequences, 512 batched tokens,
bfloat16; ``rows = config.num_seqs_for(T)``) the batch is modelled as every row ending the step at ``--context``
tokens: T <= rows is a decode-only step of T rows; a larger bucket is rows - 1 decodes and one prompt chunk of
the remaining tokens. Per step:

- bytes needed: the weights (``abstract_params`` at the config dtype; an untied embedding table counts only the
  T rows the lookup reads), the K/V of every key each row's attention sees, read once (its context, the row's
  own new tokens included: a kernel that kept them in VMEM could skip those, 1/context of a decode row's read),
  and the new tokens' K/V written once. Activations (``activation_bytes``: the tensors between matmuls and the
  logits, each written and read once) are reported beside them and in a second bound: a perfectly fused step
  would keep them on chip, and at T = 512 they are not small (SmolLM2: ~0.5 GB against 0.27 GB of weights);
- FLOPs: 2 x decoder matrix parameters x T, 2 x LM head x rows, and causal attention (4 x heads x head_dim per
  key a query sees, per layer);
- the lower bound max(bytes / HBM bandwidth, FLOPs / bf16 peak), from the published figures below, and the
  fraction of it the kernel's DMA plan allows (``step_ratio``: the bound over the bound with the bytes the kernel
  moves in place of the K/V bytes needed);
- for TPU chips, the step compiled ahead of time (``compile_targets.compile_step``) and its ``cost_analysis()``:
  XLA's flops and bytes accessed, reported as they come and not used. They are not the step's: the attention is
  a Pallas custom call with no ``pl.CostEstimate`` (the optimized HLO carries none), and the layers are a scanned
  ``while`` loop whose body XLA's count does not multiply by the trip count (SmolLM2 at T=8 on v5e: 1.06 GFLOP
  compiled with 1, 2 or 30 layers; bytes accessed 867, 682 and 623 MB, not monotone in the layers either);
- the attention kernel's plan against the K/V bytes needed: on a TPU its DMAs (``ragged_kernel_bytes``, from
  pallas_kernels/ragged_attention/tpu.py) and the old two-kernel design's (``two_kernel_bytes``); on a GPU the K/V loads
  and stores of the ``pallas_gpu`` backend's kernel (``ragged_gpu_kernel_bytes``, from
  pallas_kernels/ragged_attention/gpu.py; the engine does not call gpu_decode.py's decode kernel). A GPU's loads go
  through L1/L2, which may serve a page several programs load (a prompt chunk's query blocks, a null block):
  its figure is the bytes the programs load, an upper bound on the HBM traffic, where a TPU's DMAs are the
  traffic. Neither counts the wrapper's copies of the new K/V (XLA ops, activations) or the kernel's read of
  each new token's K/V for its write (once per token, as much as the write).

| chip | HBM GB/s | bf16 dense TFLOP/s | source |
| --- | --- | --- | --- |
| TPU v5e | 819 | 197 | cloud.google.com/tpu/docs/v5e |
| TPU v6e | 1640 | 918 | cloud.google.com/tpu/docs/v6e (its table says 1638 GBps) |
| TPU v5p | 2765 | 459 | cloud.google.com/tpu/docs/v5p |
| A100 SXM 80GB | 2039 | 312 | NVIDIA A100 datasheet |
| H100 SXM | 3350 | 989 | NVIDIA H100 datasheet (1979 is with 2:4 sparsity) |
| H200 SXM | 4800 | 989 | NVIDIA H200 datasheet |

For scale: tpu-inference (vLLM's TPU backend) reports its ragged paged attention kernel reaching 86% of HBM
bandwidth in decode; the plan's ratio here is an upper bound on such a figure for this kernel (bytes needed /
bytes it moves), before any latency the kernel does not hide.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax
import jax.numpy as jnp

from jaxpage.testing import compile_targets
from jaxpage.utils import cdiv


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_gb_s: float
    bf16_tflop_s: float
    tpu: bool  # compiled ahead of time here; a GPU gets the analytical count only


CHIPS = {c.name: c for c in (Chip("v5e", 819, 197, True), Chip("v6e", 1640, 918, True), Chip("v5p", 2765, 459, True),
                             Chip("A100", 2039, 312, False), Chip("H100", 3350, 989, False),
                             Chip("H200", 4800, 989, False))}
DEFAULT_BUCKETS = (8, 64, 512)


@dataclasses.dataclass(frozen=True)
class Seq:
    """A row of the batch: ``length`` tokens once the step has run, the last ``new`` of them in the step."""
    length: int
    new: int


def step_batch(config, num_tokens: int, context: int) -> list[Seq]:
    """The modelled batch of a bucket: every row ends at ``context`` tokens; decodes first, as the engine lays
    them out, then one prompt chunk taking the tokens the rows leave."""
    rows = config.num_seqs_for(num_tokens)
    if num_tokens == rows:
        return [Seq(context, 1)] * rows
    chunk = num_tokens - (rows - 1)
    return [Seq(context, 1)] * (rows - 1) + [Seq(max(context, chunk), chunk)]


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The pool's geometry as a kernel sees it: bytes of one page of every KV head of one layer as stored in HBM
    (a TPU pads the minor axis to 128 lanes), bytes one token's K and V need, the rows of a written tile."""
    layers: int
    block_size: int
    page_bytes: int  # one layer's page, all KV heads, padded as stored
    token_bytes: int  # one layer's K and V of one token, unpadded
    tile_rows: int

    @classmethod
    def of(cls, config, packed: bool | None = None) -> KVLayout:
        from jaxpage.attention.kv_cache import bytes_per_block, packs_kv
        from pallas_kernels.kv_write.tpu import tile_rows

        model, bs, dtype = config.model, config.cache.block_size, config.kv_dtype
        packed = packs_kv(model, config.attention_backend) if packed is None else packed
        layers = model.num_layers
        return cls(layers, bs, bytes_per_block(model, bs, dtype, lanes=128, packed=packed) // layers,
                   bytes_per_block(model, 1, dtype) // layers, tile_rows(dtype))

    @classmethod
    def gpu(cls, config) -> KVLayout:
        """The pool as the GPU kernel sees it: unpacked, unpadded (``memory_lanes`` is 1 off a TPU), written a
        token's row of each head at a time."""
        from jaxpage.attention.kv_cache import bytes_per_block

        model, bs, dtype = config.model, config.cache.block_size, config.kv_dtype
        layers = model.num_layers
        return cls(layers, bs, bytes_per_block(model, bs, dtype) // layers,
                   bytes_per_block(model, 1, dtype) // layers, 1)

    @property
    def tile_bytes(self) -> int:
        return self.page_bytes * self.tile_rows // self.block_size


def _flat_tokens(seqs: list[Seq]) -> list[tuple[int, int]]:
    """(row, position) of each token of the flat batch, rows in order."""
    return [(i, pos) for i, s in enumerate(seqs) for pos in range(s.length - s.new, s.length)]


def kv_bytes_needed(layout: KVLayout, seqs: list[Seq]) -> tuple[int, int]:
    """(read, written): each row's keys once, each new token's K/V once, over every layer."""
    per_token = layout.layers * layout.token_bytes
    return sum(s.length for s in seqs) * per_token, sum(s.new for s in seqs) * per_token


def ragged_kernel_bytes(layout: KVLayout, seqs: list[Seq], queries_per_block: int = 16) -> tuple[int, int]:
    """(read, written) HBM bytes of ragged_tpu's DMA plan over every layer, no window. The grid's query blocks
    take gcd(T, 16) tokens; in each block, every run of one row's tokens fetches whole pages 0 .. its last
    position's page (all KV heads; K and V, the lanes padded as stored), so a prompt chunk spread over several
    query blocks reads its context once per block. The run's new rows are written back as the aligned tiles
    (``tile_rows`` rows of every head) that hold them, each dirty tile once per run; the write reads nothing
    (the page is already in VMEM for attention). Head blocks split the same pages, so they add nothing."""
    tokens = _flat_tokens(seqs)
    block = math.gcd(len(tokens), queries_per_block)
    read = written = 0
    for start in range(0, len(tokens), block):
        runs: dict[int, list[int]] = {}
        for row, pos in tokens[start:start + block]:  # a row's tokens are contiguous: one run per row
            runs.setdefault(row, []).append(pos)
        for positions in runs.values():
            read += (max(positions) // layout.block_size + 1) * layout.page_bytes
            written += len({p // layout.tile_rows for p in positions}) * layout.tile_bytes
    return read * layout.layers, written * layout.layers


def two_kernel_bytes(layout: KVLayout, seqs: list[Seq], tokens_per_block: int = 8) -> tuple[int, int]:
    """(read, written) of the design before the fused write (DESIGN.md §8): write_kv_tpu reads each token's
    aligned tile and writes back each distinct tile once per grid block of gcd(T, 8) tokens, then the attention
    kernel reads the same pages as ``ragged_kernel_bytes``. That design had the unpacked pool (the packed layout
    came with the fused kernel): pass an unpacked layout."""
    attention_read, _ = ragged_kernel_bytes(layout, seqs)
    tokens = _flat_tokens(seqs)
    block = math.gcd(len(tokens), tokens_per_block)
    tiles = [(row, pos // layout.tile_rows) for row, pos in tokens]
    written = sum(len(set(tiles[i:i + block])) for i in range(0, len(tiles), block))
    return (attention_read + len(tokens) * layout.tile_bytes * layout.layers,
            written * layout.tile_bytes * layout.layers)


def gpu_blocking(config) -> tuple[int, int]:
    """(queries per block, pages per chunk) that ragged_paged_attention_gpu picks by default, as the engine
    calls it: 64 query rows over the G heads padded to a power of two, and about 64 keys of the block table."""
    from pallas_kernels.decode_attention.gpu import default_pages_per_block, next_pow2

    model = config.model
    group = next_pow2(model.num_heads // model.num_kv_heads)
    return max(1, 64 // group), default_pages_per_block(config.cache.block_size, config.max_blocks_per_seq)


def ragged_gpu_kernel_bytes(layout: KVLayout, seqs: list[Seq], queries_per_block: int, pages_per_block: int,
                            new_tokens_per_block: int = 16) -> tuple[int, int]:
    """(read, written) K/V bytes that ragged_gpu's programs load and store, over every layer, no window; pass
    ``KVLayout.gpu``. Each row's run is cut into query blocks of ``queries_per_block`` tokens from its start;
    one program per (block, KV head) loads from the pool the pages below the run's first position, in whole
    chunks of ``pages_per_block`` (pages past the row's length included: the loads are not masked), and the
    run's new K/V from the step's inputs in chunks of ``new_tokens_per_block`` tokens, from the run's first
    token through the block's last. So every query block of a prompt chunk re-reads the chunk's context and
    its new keys so far, and a decode loads ``new_tokens_per_block`` tokens' K/V for its one. Its tokens' K/V
    are stored a row of a head each: the write moves what it needs. KV heads split the loads: they add nothing."""
    read = 0
    for s in seqs:
        old_pages = cdiv(s.length - s.new, layout.block_size)  # hold the keys below the run's first position
        pool = cdiv(old_pages, pages_per_block) * pages_per_block * layout.page_bytes
        for first in range(0, s.new, queries_per_block):
            through = min(first + queries_per_block, s.new)  # the run's tokens up to the block's last
            read += pool + cdiv(through, new_tokens_per_block) * new_tokens_per_block * layout.token_bytes
    return read * layout.layers, sum(s.new for s in seqs) * layout.token_bytes * layout.layers


@dataclasses.dataclass
class WeightCount:
    bytes: int  # what a step reads
    decoder_params: int  # matrix parameters every token goes through
    head_params: int  # the LM head, applied to one row per sequence


def weight_count(config, num_tokens: int) -> WeightCount:
    from jaxpage.models import abstract_params

    params = abstract_params(config.step_model, config.dtype)
    size = lambda a: math.prod(a.shape)  # noqa: E731
    total = sum(size(a) * a.dtype.itemsize for a in jax.tree.leaves(params))
    embed = params["embed"]["embedding"]
    decoder = sum(size(a) for a in jax.tree.leaves(params["layers"]) if a.ndim >= 3)  # stacked matrices
    if config.model.tie_word_embeddings:
        return WeightCount(total, decoder, size(embed))
    head = sum(size(a) for a in jax.tree.leaves(params["lm_head"]))
    lookup = num_tokens * embed.shape[-1] * embed.dtype.itemsize
    return WeightCount(total - size(embed) * embed.dtype.itemsize + lookup, decoder, head)


def activation_bytes(config, num_tokens: int, rows: int) -> int:
    """Each matmul's input and output written once and read once per layer (XLA fuses the elementwise ops
    around a matmul but keeps the tensors between matmuls in HBM), at the config dtype, and the float32
    logits of the rows, written and read by the sampler."""
    m = config.model
    per_token = (m.hidden_size + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + m.num_heads * m.head_dim
                 + m.hidden_size + 2 * m.intermediate_size + m.intermediate_size + m.hidden_size)
    itemsize = jnp.dtype(config.dtype).itemsize
    return 2 * (num_tokens * per_token * itemsize * m.num_layers + rows * m.vocab_size * 4)


def attention_flops(config, seqs: list[Seq]) -> int:
    """QK^T and PV for the keys each query sees (causal), every layer."""
    model = config.model
    keys = sum(pos + 1 for _, pos in _flat_tokens(seqs))
    return 4 * model.num_heads * model.head_dim * keys * model.num_layers


@dataclasses.dataclass
class StepRow:
    model: str
    chip: str
    num_tokens: int
    rows: int
    context: int
    weight_bytes: int
    activation_bytes: int
    kv_read_bytes: int  # needed
    kv_write_bytes: int
    flops: int
    attention_flops: int
    bound_s: float  # weights and K/V
    bound_with_activations_s: float
    bound_by: str  # "memory" or "compute"
    kernel_read_bytes: int = 0  # the attention kernel's plan: a TPU's DMAs, a GPU's loads and stores
    kernel_write_bytes: int = 0
    kv_ratio: float = 0.0  # K/V bytes needed / K/V bytes the kernel moves
    read_ratio: float = 0.0  # the same, reads only
    step_ratio: float = 0.0  # the bound / the bound with the kernel's K/V bytes in place of the needed ones
    old_kv_ratio: float | None = None  # the two-kernel TPU design on the unpacked pool
    xla_flops: float | None = None  # cost_analysis() of the compiled step (the Pallas call counts nothing)
    xla_bytes: float | None = None
    compile_s: float | None = None
    compile_error: str = ""

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


def model_step(model: str, chip: Chip, num_tokens: int, context: int, config=None) -> StepRow:
    """The analytical part of a row: bytes, FLOPs, the bound, and the attention kernel's plan."""
    config = config or compile_targets.engine_config(model)
    seqs = step_batch(config, num_tokens, context)
    layout = KVLayout.of(config)
    weights = weight_count(config, num_tokens)
    activations = activation_bytes(config, num_tokens, len(seqs))
    kv_read, kv_write = kv_bytes_needed(layout, seqs)
    attention = attention_flops(config, seqs)
    flops = 2 * weights.decoder_params * num_tokens + 2 * weights.head_params * len(seqs) + attention
    compute_s = flops / (chip.bf16_tflop_s * 1e12)
    bound = lambda moved: max(moved / (chip.hbm_gb_s * 1e9), compute_s)  # noqa: E731
    needed = weights.bytes + kv_read + kv_write
    row = StepRow(model, chip.name, num_tokens, len(seqs), context, weights.bytes, activations, kv_read, kv_write,
                  flops, attention, bound(needed), bound(needed + activations),
                  "memory" if bound(needed) > compute_s else "compute")
    if chip.tpu:
        read, written = ragged_kernel_bytes(layout, seqs)
        row.old_kv_ratio = (kv_read + kv_write) / sum(two_kernel_bytes(KVLayout.of(config, packed=False), seqs))
    else:
        read, written = ragged_gpu_kernel_bytes(KVLayout.gpu(config), seqs, *gpu_blocking(config))
    row.kernel_read_bytes, row.kernel_write_bytes = read, written
    row.kv_ratio, row.read_ratio = (kv_read + kv_write) / (read + written), kv_read / read
    row.step_ratio = row.bound_s / bound(weights.bytes + read + written)
    return row


def add_compile(row: StepRow, config) -> StepRow:
    """The step compiled for the row's TPU chip, and what the compiler's cost analysis counts."""
    compiled = compile_targets.compile_step(row.chip, row.model, row.num_tokens, config)
    row.compile_s = round(compiled.seconds, 1)
    if not compiled.ok:
        row.compile_error = compiled.error
    row.xla_flops, row.xla_bytes = compiled.cost.get("flops"), compiled.cost.get("bytes accessed")
    return row


def run(models, chips, buckets, context: int, compile_steps: bool = True) -> list[StepRow]:
    results = []
    for model in models:
        config = compile_targets.engine_config(model)
        for chip in chips:
            for num_tokens in (t for t in config.token_buckets() if t in buckets):
                row = model_step(model, CHIPS[chip], num_tokens, context, config)
                if compile_steps and CHIPS[chip].tpu:
                    add_compile(row, config)
                print(table_line(row), flush=True)
                results.append(row)
    return results


HEADER = ("| model | chip | T | rows | weights / activations MB | KV read / written MB | GFLOP (attention) | "
          "bound us (with activations) | by | kernel K/V MB | K/V ratio (reads) | step ratio | "
          "old design K/V ratio | XLA GFLOP / MB | compile s |\n" + "| --- " * 15 + "|")


def table_line(r: StepRow) -> str:
    mb = lambda b: f"{b / 1e6:,.1f}"  # noqa: E731
    xla = (f"{r.xla_flops / 1e9:,.2f} / {mb(r.xla_bytes)}" if r.xla_flops is not None and r.xla_bytes is not None
           else (r.compile_error[:60] or "-"))
    old = "-" if r.old_kv_ratio is None else f"{r.old_kv_ratio:.3f}"
    kernel = (f"{mb(r.kernel_read_bytes + r.kernel_write_bytes)} | {r.kv_ratio:.3f} ({r.read_ratio:.3f}) | "
              f"{r.step_ratio:.3f} | {old}" if r.kernel_read_bytes else "- | - | - | -")
    cells = [r.model, r.chip, r.num_tokens, r.rows, f"{mb(r.weight_bytes)} / {mb(r.activation_bytes)}",
             f"{mb(r.kv_read_bytes)} / {mb(r.kv_write_bytes)}",
             f"{r.flops / 1e9:,.2f} ({r.attention_flops / 1e9:,.2f})",
             f"{r.bound_s * 1e6:,.1f} ({r.bound_with_activations_s * 1e6:,.1f})", r.bound_by, kernel, xla,
             "-" if r.compile_s is None else r.compile_s]
    return "| " + " | ".join(map(str, cells)) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", nargs="+", default=list(CHIPS), choices=list(CHIPS))
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3-8b"],
                        choices=list(compile_targets.MODELS))
    parser.add_argument("--context", type=int, default=1024, help="tokens each row holds after the step")
    parser.add_argument("--buckets", nargs="+", type=int, default=list(DEFAULT_BUCKETS),
                        help="token buckets (those the engine has)")
    parser.add_argument("--no-compile", action="store_true", help="the analytical model only")
    parser.add_argument("--json", help="write the raw rows here")
    args = parser.parse_args()
    print(f"context {args.context} tokens a row after the step; MB = 1e6 bytes\n\n{HEADER}")
    rows = run(args.models, args.chips, args.buckets, args.context, not args.no_compile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
