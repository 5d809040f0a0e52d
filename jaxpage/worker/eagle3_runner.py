"""Speculative decoding's ``eagle3`` method: an EAGLE-3 head (jaxpage.models.eagle3) over a KV pool of its own
that has the target's blocks, indexed by the target's block tables, and the k steps before each target step
that propose each speculating row's draft tokens.

The head's K/V of position p sit at the slot of position p. Each target step's auxiliary hidden states come back
with its tokens (``take_hidden_states``) and wait here per sequence until the head's next pass computes those
positions; the head sees a sequence shifted by one (position p holds token p + 1: ``_view``). A pass first
computes every position the target computed since the last pass (the last one samples the first draft), then one
position per further draft from the head's own output. A pass starts again from the target's first new position:
drafted positions the target rejected, or computed from drafts, are computed afresh from the target's hidden
states (vLLM's EAGLE does the same). Drafts are drawn as the request samples (its seed's key at that output
index), each with the distribution q it was drawn from, which the target's step verifies
(``sampler.rejection_sample``). A position with no target hidden state here (a fork's prompt, a prefix another
sequence computed) is computed from zeros: its drafts are worse, never wrong."""
from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpage.attention.kv_cache import allocate_kv_pool, host_kv_pool, jit_on_pool, packs_kv, pool_block_size
from jaxpage.attention.block_moves import BlockMoves, padded_chunks
from jaxpage.config import EngineConfig
from jaxpage.core.kv_cache_manager import DeviceOps
from jaxpage.core.scheduler_output import ScheduledSeq
from jaxpage.distributed.parallel import placement
from jaxpage.models.eagle3 import Eagle3Config, head_graph, target_logits
from jaxpage.sequence import Sequence, SequenceGroup
from jaxpage.worker.input_batch import InputBatch, build_batch, pick_bucket
from jaxpage.worker.model_runner import move_padded
from jaxpage.worker.sampler import SamplerOutput, sample
from jaxpage.worker.step import abstract_step_inputs
from jaxpage.worker.warmup import compile_all, compile_threads


def head_step(config: EngineConfig, head: Eagle3Config, from_target: bool, params: dict, pool, batch, hidden,
              sampling) -> tuple[tuple[SamplerOutput, jax.Array], jax.Array]:
    """One pass of the head over a flat batch: ((each row's draft and its q, each row's next hidden input), pool).
    hidden [T, A * D] the target's (``from_target``) or [T, D] the head's own."""
    model = nnx.merge(head_graph(head), params["head"])
    out, nxt, pool = model(pool, batch, hidden, from_target, config.attention_backend, pool_block_size(pool))
    rows = batch.logits_indices
    logits = target_logits(head, model.lm_head(out[rows]), params["d2t"])
    return (sample(logits, sampling, with_probs=True), nxt[rows]), pool


class HiddenStates:
    """The target's auxiliary hidden states per sequence, by position, kept until the head computes them."""

    def __init__(self):
        self._held: weakref.WeakKeyDictionary[Sequence, tuple[int, np.ndarray]] = weakref.WeakKeyDictionary()

    def store(self, seq: Sequence, first: int, states: np.ndarray) -> None:
        """Positions [first, first + len(states)): they replace what was held from ``first`` on."""
        held = self._held.get(seq)
        if held is not None and held[0] <= first <= held[0] + len(held[1]):
            states = np.concatenate([held[1][:first - held[0]], states])
            first = held[0]
        self._held[seq] = (first, states)

    def first(self, seq: Sequence) -> int | None:
        held = self._held.get(seq)
        return None if held is None else held[0]

    def take(self, seq: Sequence, lo: int, hi: int, width: int) -> np.ndarray:
        """Positions [lo, hi) (zeros where none is held); those before hi - 1 are dropped."""
        out = np.zeros((hi - lo, width), np.float32)
        held = self._held.get(seq)
        if held is not None:
            first, states = held
            a, b = max(lo, first), min(hi, first + len(states))
            if a < b:
                out[a - lo:b - lo] = states[a - first:b - first]
            keep = max(hi - 1, first)
            self._held[seq] = (keep, states[keep - first:])
        return out


class Eagle3Runner:
    def __init__(self, config: EngineConfig, head: Eagle3Config, params: dict, eos_token_ids=()):
        self.config, self.head = config, head
        where = placement(config)
        dtype = jnp.dtype(config.dtype)
        self.params = {"head": jax.tree.map(lambda a: jax.device_put(np.asarray(a, dtype), where), params["head"]),
                       "d2t": jax.device_put(params["d2t"], where)}
        kv_dtype, packed = jnp.dtype(config.kv_dtype), packs_kv(config.model, config.attention_backend)
        cache = config.cache
        self.kv_pool = allocate_kv_pool(config.model, cache.num_kv_blocks, cache.block_size, kv_dtype, where, packed)
        self.host_pool = (host_kv_pool(config.model, cache.num_host_blocks, cache.block_size, kv_dtype, packed)
                          if cache.num_host_blocks else None)
        self.block_moves = BlockMoves.jit(where, kv_dtype, packed)
        self._move_size = config.scheduler.max_num_seqs
        self._steps = {flag: jit_on_pool(functools.partial(head_step, config, head, flag), 5, 1, "pair", where,
                                         None, config.kv_dtype, packed) for flag in (True, False)}
        self._compiled: dict[tuple[int, bool], object] = {}
        self.input_batch = InputBatch(config)
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.hidden = HiddenStates()
        # positions whose head K/V came from the target's hidden states, per sequence
        self._computed: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self._views: weakref.WeakKeyDictionary[Sequence, Sequence] = weakref.WeakKeyDictionary()

    # --- warm-up and block moves ---------------------------------------------------------------------
    def programs(self) -> list[tuple[int, bool]]:
        """(token bucket, from the target's hidden states): every bucket's first pass, and the further passes'
        (one token per speculating row) buckets."""
        buckets = self.config.token_buckets()
        most_rows = pick_bucket(buckets, self.config.scheduler.max_num_seqs)
        return [(b, True) for b in buckets] + [(b, False) for b in buckets if b <= most_rows]

    def warm_up(self, progress: bool = True) -> None:
        programs = [p for p in self.programs() if p not in self._compiled]
        compiled = compile_all(self._compile, programs, compile_threads(len(programs)), progress)
        for program in programs:
            num_tokens, from_target = program
            inputs = (*abstract_step_inputs(self.config, num_tokens), self._hidden_input(num_tokens, from_target))
            batch, sampling, hidden = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), inputs)
            out, self.kv_pool = compiled[program](self.params, self.kv_pool, batch, hidden, sampling)
            jax.block_until_ready(out)
            self._compiled[program] = compiled[program]
        idle = np.zeros(self._move_size, np.int32)
        self.kv_pool = self.block_moves.copy(self.kv_pool, idle, idle)

    def _hidden_input(self, num_tokens: int, from_target: bool) -> jax.ShapeDtypeStruct:
        width = self.head.aux_width if from_target else self.config.model.hidden_size
        return jax.ShapeDtypeStruct((num_tokens, width), jnp.float32)

    def _compile(self, program: tuple[int, bool]):
        num_tokens, from_target = program
        batch, sampling = abstract_step_inputs(self.config, num_tokens)
        return self._steps[from_target].lower(self.params, self.kv_pool, batch,
                                              self._hidden_input(num_tokens, from_target), sampling).compile()

    def apply(self, ops: DeviceOps) -> None:
        """The target's block moves, applied to the head's pool too."""
        for kind, src, dst in ops.batches():
            for padded_src, padded_dst, n in padded_chunks(src, dst, self._move_size):
                self.kv_pool = move_padded(self.block_moves, self.kv_pool, self.host_pool, kind, padded_src,
                                           padded_dst, n)

    # --- proposing ------------------------------------------------------------------------------------
    def take_hidden_states(self, scheduled: list[ScheduledSeq], sampled: SamplerOutput) -> None:
        """A target step's auxiliary hidden states (per token of its flat batch, rows in order), kept by
        sequence and position; called before the scheduler takes the step's tokens."""
        states, offset = sampled.hidden_states, 0
        for s in scheduled:
            n = s.num_new_tokens
            if n:
                self.hidden.store(s.seq, s.seq.num_computed_tokens, np.asarray(states[offset:offset + n]))
                offset += n

    def propose(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The rows with each speculating row's reserved draft positions (``num_pending_drafts``) filled in
        (``spec_token_ids`` and ``draft_probs``: new rows, the scheduler's unchanged)."""
        first, spec, drafts, q = [], [], {}, {}
        for s in scheduled:
            if not s.num_new_tokens:
                continue  # a fork: its parent's row computes its tokens
            seq, end = s.seq, s.seq.num_computed_tokens  # positions the target computed (their tokens p + 1 known)
            if s.num_pending_drafts and not end:  # a one-token prompt: no position has its next token yet
                drafts[id(s)], q[id(s)] = self._blind_drafts(seq.token_ids[-1], s.num_pending_drafts)
                continue
            # from the first whose target states are held: before it, K/V an earlier pass computed (of this
            # sequence, or of a prefix another sequence computed); none held: a fork, nothing to catch up
            held = self.hidden.first(seq)
            start = max(min(self._computed.get(seq, 0), end), end if held is None else held)
            if s.num_pending_drafts:
                start = min(start, end - 1)  # the row's draft comes from its last computed position
            if start < end:
                first.append((s, start, end, []))
                if s.num_pending_drafts:
                    spec.append((len(first) - 1, s))
        if not first:
            return self._filled(scheduled, drafts, q)
        hidden = np.concatenate([self.hidden.take(s.seq, a, b, self.head.aux_width) for s, a, b, _ in first])
        tokens, probs, nxt = self._step(first, hidden, True)
        for s, _, end, _ in first:
            self._computed[s.seq] = end
        drafts.update({id(s): [tokens[row]] for row, s in spec})
        q.update({id(s): [probs[row]] for row, s in spec})
        prev = {id(s): nxt[row] for row, s in spec}
        for j in range(1, max((s.num_pending_drafts for _, s in spec), default=0)):
            rows = [s for _, s in spec if s.num_pending_drafts > j]
            at = [s.seq.num_computed_tokens + j - 1 for s in rows]  # the position whose token is draft j
            tokens, probs, nxt = self._step([(s, p, p + 1, drafts[id(s)]) for s, p in zip(rows, at)],
                                            np.stack([prev[id(s)] for s in rows]), False)
            for row, s in enumerate(rows):
                drafts[id(s)].append(tokens[row])
                q[id(s)].append(probs[row])
                prev[id(s)] = nxt[row]
        return self._filled(scheduled, drafts, q)

    @staticmethod
    def _filled(scheduled: list[ScheduledSeq], drafts: dict, q: dict) -> list[ScheduledSeq]:
        """The rows with their drafts and q (by the row's id) in place of their reserved positions."""
        return [dataclasses.replace(s, spec_token_ids=tuple(drafts[id(s)]), draft_probs=np.stack(q[id(s)]),
                                    num_pending_drafts=0)
                if id(s) in drafts else s for s in scheduled]

    def _blind_drafts(self, token: int, n: int) -> tuple[list[int], list[np.ndarray]]:
        """Drafts without the head: ``token`` n times, each drawn with certainty (q one-hot), which the rule
        verifies as any draft."""
        one_hot = np.zeros(self.config.model.vocab_size, np.float32)
        one_hot[token] = 1.0
        return [token] * n, [one_hot] * n

    def _step(self, rows: list[tuple[ScheduledSeq, int, int, list[int]]], hidden: np.ndarray, from_target: bool):
        """One pass: each (target row, start, end, extra) computes the head's positions [start, end) of its
        sequence seen shifted by one and extended by ``extra`` (its drafts so far), sampling after ``end`` where
        that is the view's last token; returns each row's token, q and next hidden input."""
        scheduled = []
        for s, start, end, extra in rows:
            view = self._view(s.seq, start, extra)
            group = SequenceGroup(s.group.request_id, [view], s.group.params, arrival=0)  # no prompt logprobs
            scheduled.append(ScheduledSeq(view, end - start, group, end == view.num_tokens, s.block_ids))
        batch, sampling = build_batch(self.config, scheduled, self.eos_token_ids, self.input_batch)
        num_tokens = batch.token_ids.shape[0]
        padded = np.zeros((num_tokens, hidden.shape[1]), np.float32)
        padded[:len(hidden)] = hidden
        (out, nxt), self.kv_pool = self._compiled[(num_tokens, from_target)](self.params, self.kv_pool, batch,
                                                                             padded, sampling)
        # a view's tokens changed other than by appending: its penalty history is synced afresh next time
        self.input_batch.penalty_history.forget([s.seq for s, (*_, extra) in zip(scheduled, rows) if extra])
        return np.asarray(out.tokens).tolist(), np.asarray(out.probs), np.asarray(nxt, np.float32)

    def _view(self, seq: Sequence, start: int, extra: list[int]) -> Sequence:
        """The head's Sequence for a target sequence: its tokens from the second on (the head's position p holds
        token p + 1), then ``extra``; ``start`` of them computed."""
        view = self._views.get(seq)
        if view is None:
            view = self._views[seq] = Sequence(seq.seq_id, [], max(seq.num_prompt_tokens - 1, 0), seq.max_len,
                                               seed=seq.seed, lora_int_id=seq.lora_int_id)
        view.token_ids = seq.token_ids[1:] + extra
        view.num_computed_tokens = start
        return view
