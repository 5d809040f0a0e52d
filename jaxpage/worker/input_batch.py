"""The step's inputs on the host: InputBatch (vLLM's), the runner's persistent per-sequence rows, and
build_batch, which turns the scheduled sequences into one flat batch padded to its buckets: its token part
(``build_token_batch``) and its sampling part (``build_sampling_batch``)."""
from __future__ import annotations

import functools

import numpy as np

from jaxpage.config import EngineConfig, pick_bucket
from jaxpage.core.prompt_logprobs import no_targets, prompt_targets
from jaxpage.core.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledSeq
from jaxpage.core.stop import reached_min_tokens
from jaxpage.distributed.parallel import put
from jaxpage.models import TokenBatch
from jaxpage.sampling_params import MAX_LOGIT_BIAS
from jaxpage.sequence import Sequence
from jaxpage.worker.penalty_history import PenaltyHistory
from jaxpage.worker.sampler import MAX_BANNED, SamplingBatch
from jaxpage.worker.step import all_allowed, replicated


class InputBatch:
    """What build_batch keeps between steps, as vLLM's InputBatch: each sequence's block-table row and sampling
    settings in persistent numpy arrays, indexed by a row the sequence keeps while it runs.

    A row is (re)written only when its sequence's block table differs from the copy kept here (a new block,
    copy-on-write, swap, preemption) or the sequence is new to it; a step then gathers its rows in one go instead
    of rebuilding every table from Python lists. Entries are keyed by the Sequence object itself (not its id,
    which engines sharing a runner reuse), whose seed and sampling parameters are fixed for its life. Rows of
    sequences gone are taken back when the rows run out. Row 0 stays the padding row (null blocks, neutral
    sampling settings).

    ``sampled_rows_apart``: the sampling part of a batch pads its rows to ``config.sampled_row_buckets()`` instead of
    the token bucket's sequence count (the host layer loop, whose sampler is a program of its own per row count;
    the fused step is one program per token bucket, so there they stay tied).
    """

    _FIELDS = {"tables": (np.int32, 0), "temperature": (np.float32, 0), "top_k": (np.int32, 0),
               "top_p": (np.float32, 1), "min_p": (np.float32, 0), "seeds": (np.uint32, 0), "want_top": (bool, 0),
               "special_below": (np.int64, 0),  # special_below: the row needs special inputs while steps < this
               "num_prompt": (np.int64, 0),
               "logit_bias_ids": (np.int32, -1), "logit_bias": (np.float32, 0)}  # [rows, MAX_LOGIT_BIAS]

    def __init__(self, config: EngineConfig, sampled_rows_apart: bool = False):
        self.config = config
        self.sampled_rows_apart = sampled_rows_apart
        self.sampled_row_buckets = config.sampled_row_buckets()
        self._entries: dict[Sequence, list] = {}  # sequence -> [copy of its block table, row]
        self._allocate(config.scheduler.max_num_seqs * 2 + 1)
        self.penalty_history = PenaltyHistory(config.scheduler.max_num_seqs, config.scheduler.max_model_len,
                                              replicated(config),
                                              1 + config.num_draft_tokens)

    def _allocate(self, capacity: int) -> None:
        """Makes room for ``capacity`` rows, keeping the rows written so far."""
        old = len(self.tables) if hasattr(self, "tables") else 1
        for name, (dtype, fill) in self._FIELDS.items():
            width = {"tables": self.config.max_blocks_per_seq, "logit_bias_ids": MAX_LOGIT_BIAS,
                     "logit_bias": MAX_LOGIT_BIAS}.get(name)
            shape = (capacity,) if width is None else (capacity, width)
            array = np.full(shape, fill, dtype)
            if hasattr(self, name):
                array[:old] = getattr(self, name)
            setattr(self, name, array)
        self._free_rows = getattr(self, "_free_rows", []) + list(range(capacity - 1, old - 1, -1))

    def rows(self, scheduled: list[ScheduledSeq]) -> list[int]:
        """Each scheduled sequence's row, (re)written first where its block table changed or it is new here."""
        entries, write = self._entries, self._write
        rows = []
        for s in scheduled:
            seq = s.seq
            entry = entries.get(seq)
            if entry is None or entry[0] != s.block_ids:
                entry = write(seq, s.block_ids, s.group.params, entry, scheduled)
            rows.append(entry[1])
        return rows

    def _write(self, seq, table, p, entry, scheduled: list[ScheduledSeq]) -> list:
        if entry is None:
            if not self._free_rows:  # drop the rows of sequences that are not in this step (finished, or idle)
                keep = {s.seq for s in scheduled}
                for gone in [q for q in self._entries if q not in keep]:
                    self._free_rows.append(self._entries.pop(gone)[1])
                if not self._free_rows:
                    self._allocate(2 * len(self.tables))
            row, old_len = self._free_rows.pop(), self.tables.shape[1]
        else:
            row, old_len = entry[1], len(entry[0])
        self.tables[row, :len(table)] = table
        if old_len > len(table):
            self.tables[row, len(table):old_len] = 0
        self.temperature[row], self.top_k[row], self.top_p[row], self.min_p[row] = (p.temperature, p.top_k,
                                                                                    p.top_p, p.min_p)
        self.seeds[row] = seq.seed
        self.num_prompt[row] = seq.num_prompt_tokens
        self.want_top[row] = p.logprobs is not None or p.use_beam_search
        self.special_below[row] = np.iinfo(np.int64).max if p.has_penalties else p.min_tokens
        self.logit_bias_ids[row] = -1
        if p.logit_bias:
            self.logit_bias_ids[row, :len(p.logit_bias)] = list(p.logit_bias)
            self.logit_bias[row, :len(p.logit_bias)] = list(p.logit_bias.values())
        entry = self._entries[seq] = [list(table), row]
        return entry


def build_batch(config: EngineConfig, scheduled: list[ScheduledSeq], eos_token_ids: tuple[int, ...] = (),
                state: InputBatch | None = None, bitmask: np.ndarray | None = None) -> tuple[TokenBatch, SamplingBatch]:
    """The flat batch in numpy, padded to its buckets. Padding tokens write to the null block.

    This runs every step for every sequence: the per-sequence block tables and sampling settings come from the
    persistent ``state`` (the runner's InputBatch; a fresh one if none is given), only the token ids and positions
    are gathered in Python, and everything else is computed on whole arrays.
    """
    state = state if state is not None else InputBatch(config)
    batch, index, decode = build_token_batch(config, scheduled, state)
    steps = _steps(scheduled, state, index, batch.positions, decode)
    num_tokens = len(batch.token_ids)  # a decode row's token is its sequence's last: no prompt target
    targets = no_targets(num_tokens) if decode else prompt_targets(scheduled, num_tokens)
    return batch, build_sampling_batch(config, scheduled, state, index, steps, eos_token_ids, bitmask, targets)


def build_token_batch(config: EngineConfig, scheduled: list[ScheduledSeq],
                      state: InputBatch) -> tuple[TokenBatch, np.ndarray, bool]:
    """The batch's token part: token ids, positions, slots, each token's row, block tables and each row's
    logits index, padded to the token bucket; with each sampled row's InputBatch row (``index``, padded to the
    sampled rows' size; padding rows read row 0, the padding row) and whether every row is a decode row (one
    token, its sequence's last, sampled)."""
    num_rows, rows = len(scheduled), state.rows(scheduled)
    decode_tokens = _decode_tokens(scheduled)
    if decode_tokens is not None:
        (token_ids, positions), token_seq, logits_indices, forks = decode_tokens, None, None, []
    else:
        token_ids, positions, token_seq, logits_indices, forks = _flat_tokens(scheduled)
        if len(logits_indices) > num_rows:  # speculative decoding: each draft position's row, state row its own
            rows = rows + [rows[r] for r, s in enumerate(scheduled) for _ in s.spec_token_ids]
            num_rows = len(rows)
    count = len(token_ids)
    num_tokens = pick_bucket(config.token_buckets(), max(count, num_rows, 1))  # forks add rows
    num_seqs = config.num_seqs_for(num_tokens)
    index = np.zeros(num_seqs, np.intp)
    index[:num_rows] = rows
    tables = state.tables[index]
    if forks:  # rows that compute no token: no block table
        tables[forks] = 0
    ids, pos = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    ids[:count], pos[:count] = token_ids, positions
    tok_seq, logits = _token_rows(count, num_rows, num_tokens, num_seqs, token_seq, logits_indices)
    slots = _slots(tables, tok_seq[:count], pos[:count], config.cache.block_size, num_tokens)
    sampled = pick_bucket(state.sampled_row_buckets, max(num_rows, 1)) if state.sampled_rows_apart else num_seqs
    return TokenBatch(ids, pos, slots, tok_seq, tables, logits), index[:sampled], decode_tokens is not None


def _decode_tokens(scheduled: list[ScheduledSeq]) -> tuple[list[int], list[int]] | None:
    """(each row's token, its position) when every row is a decode row; None otherwise."""
    token_ids, positions = [], []
    for s in scheduled:
        if s.num_new_tokens != 1 or not s.samples or s.logits_of is not None:
            return None
        first = s.seq.num_computed_tokens
        positions.append(first)
        ids = s.seq.token_ids
        token_ids.append(ids[first] if first < len(ids) else PLACEHOLDER_TOKEN_ID)  # see _tokens
    return token_ids, positions


def _tokens(seq: Sequence, first: int, n: int) -> list[int]:
    """The sequence's tokens [first, first + n): where a launched step's token is still on the device (a
    placeholder, Sequence.num_placeholders), PLACEHOLDER_TOKEN_ID, which the step replaces with that token."""
    known = seq.token_ids[first:first + n]
    return known if len(known) == n else known + [PLACEHOLDER_TOKEN_ID] * (n - len(known))


def _flat_tokens(scheduled: list[ScheduledSeq]):
    """Every row's scheduled tokens, flat: (token ids, positions, each token's row, each row's logits index,
    the fork rows: those that compute no token, sampling their parent's logits). A speculating row's tokens are
    its last token and its drafts; a row per draft position follows the scheduled rows (sampling there, no
    tokens of its own, as forks), in order."""
    token_ids, positions, token_seq, logits_indices, forks = [], [], [], [], []
    last_index: dict[int, int] = {}
    verify: list[int] = []  # speculative decoding: the draft positions' logits indices
    for row, s in enumerate(scheduled):
        seq, n = s.seq, s.num_new_tokens
        if n:
            first = seq.num_computed_tokens
            if n == 1:
                ids = seq.token_ids
                token_ids.append(ids[first] if first < len(ids) else PLACEHOLDER_TOKEN_ID)  # see _tokens
                positions.append(first)
                token_seq.append(row)
            else:
                token_ids.extend(_tokens(seq, first, n) if not s.spec_token_ids
                                 else (*_tokens(seq, first, 1), *s.spec_token_ids))
                positions.extend(range(first, first + n))
                token_seq.extend([row] * n)
                if s.spec_token_ids:
                    verify.extend(range(len(token_ids) - n, len(token_ids) - 1))
            last_index[seq.seq_id] = len(token_ids) - 1
        else:
            forks.append(row)
        logits_indices.append(last_index[(s.logits_of or seq).seq_id])
    if verify:
        forks.extend(range(len(logits_indices), len(logits_indices) + len(verify)))
        logits_indices.extend(verify)
    return token_ids, positions, token_seq, logits_indices, forks


def _token_rows(count: int, num_rows: int, num_tokens: int, num_seqs: int, token_seq, logits_indices):
    """(each token's row, each row's logits index), padded; None for a decode batch, whose row i's token is
    token i: then shared, read-only arrays."""
    if token_seq is None:
        return _decode_rows(count, num_tokens), _decode_rows(count, num_seqs)
    tok_seq, logits = np.zeros(num_tokens, np.int32), np.zeros(num_seqs, np.int32)
    tok_seq[:count], logits[:num_rows] = token_seq, logits_indices
    return tok_seq, logits


@functools.lru_cache(maxsize=64)
def _decode_rows(count: int, size: int) -> np.ndarray:
    """0, 1, ..., count - 1, then zeros up to size (int32, read-only): a decode step's token rows and logits."""
    rows = np.zeros(size, np.int32)
    rows[:count] = np.arange(count)
    rows.flags.writeable = False
    return rows


def _slots(tables: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, block_size: int,
           num_tokens: int) -> np.ndarray:
    """Each token's slot in the pool, through its row's block table; padding tokens: slot 0 (the null block)."""
    slots = np.zeros(num_tokens, np.int32)
    if len(positions):
        at = positions.astype(np.int64)
        slots[:len(at)] = tables[token_rows, at // block_size].astype(np.int64) * block_size + at % block_size
    return slots


def _steps(scheduled: list[ScheduledSeq], state: InputBatch, index: np.ndarray, positions: np.ndarray,
           decode: bool) -> np.ndarray:
    """Each row's tokens generated so far (num_output_tokens, placeholders counted), padded: the output index of the
    token it samples (its seed's key). A speculating row samples after its drafts; the draft positions' rows
    follow the scheduled rows."""
    num_rows = len(scheduled)
    steps = np.zeros(len(index), np.int32)
    if decode:  # the token computed is the sequence's last
        steps[:num_rows] = positions[:num_rows].astype(np.int64) + 1 - state.num_prompt[index[:num_rows]]
    elif state.config.speculative_config is None:
        steps[:num_rows] = [len(q.token_ids) + q.num_placeholders - q.num_prompt_tokens  # num_output_tokens
                            for q in (s.seq for s in scheduled)]
    else:
        outputs = [s.seq.num_output_tokens for s in scheduled]
        steps[:num_rows] = [n + len(s.spec_token_ids) for n, s in zip(outputs, scheduled)]
        drafts = [n + j for n, s in zip(outputs, scheduled) for j in range(len(s.spec_token_ids))]
        steps[num_rows:num_rows + len(drafts)] = drafts
    return steps


def build_sampling_batch(config: EngineConfig, scheduled: list[ScheduledSeq], state: InputBatch, index: np.ndarray,
                         steps: np.ndarray, eos_token_ids: tuple[int, ...] = (),
                         bitmask: np.ndarray | None = None,
                         targets: np.ndarray | None = None) -> SamplingBatch:
    """The batch's sampling part: each row's settings gathered from its InputBatch row (``index``), penalties
    and banned tokens for the rows that need them, the penalty history, the bitmask (None: any token) and the
    tokens' prompt ``targets`` (core/prompt_logprobs.py; None: a step without prompt logprobs)."""
    num_rows, num_seqs = len(scheduled), len(index)
    special_rows = np.flatnonzero(steps[:num_rows] < state.special_below[index[:num_rows]]).tolist()
    presence, frequency, repetition, history_rows, num_prompt, banned, extra = _special_inputs(
        scheduled, state, special_rows, num_seqs, eos_token_ids, replicated(config), config.num_draft_tokens)
    return SamplingBatch(
        state.temperature[index], state.top_k[index], state.top_p[index], state.min_p[index], state.seeds[index],
        steps, presence, frequency, repetition, state.penalty_history.table, history_rows, num_prompt, banned,
        np.bool_(state.want_top[index].any()), _bitmask_rows(bitmask, num_seqs, config),
        *_logit_bias_rows(state, index, num_rows, replicated(config)), targets,
        *(_draft_rows(scheduled, num_seqs, config.model.vocab_size) if config.verifies_draft_probs else (None, None)),
        extra)


def _draft_rows(scheduled: list[ScheduledSeq], num_seqs: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(draft ids [S], -1 elsewhere; draft probs [S, vocab]) of a draft model's target: each draft position's
    row (after the scheduled rows, in order) with the draft token it verifies and the draft's distribution."""
    ids, probs = np.full(num_seqs, -1, np.int32), np.zeros((num_seqs, vocab), np.float32)
    at = len(scheduled)
    for s in scheduled:
        if s.spec_token_ids:
            n = len(s.spec_token_ids)
            ids[at:at + n], probs[at:at + n] = s.spec_token_ids, s.draft_probs
            at += n
    return ids, probs


def _logit_bias_rows(state: InputBatch, index: np.ndarray, num_rows: int, sharding) -> tuple:
    """(token ids, biases) [num_seqs, MAX_LOGIT_BIAS] of the rows' logit_bias: gathered when a row has one, else
    the shared unbiased arrays, on the device(s) once per shape (a step without a bias transfers nothing for it)."""
    if (state.logit_bias_ids[index[:num_rows], 0] >= 0).any():
        return state.logit_bias_ids[index], state.logit_bias[index]
    return _no_logit_bias(len(index), sharding)


@functools.lru_cache(maxsize=64)
def _no_logit_bias(num_seqs: int, sharding) -> tuple:
    return (put(np.full((num_seqs, MAX_LOGIT_BIAS), -1, np.int32), sharding),
            put(np.zeros((num_seqs, MAX_LOGIT_BIAS), np.float32), sharding))


def _special_inputs(scheduled: list[ScheduledSeq], state: InputBatch, special_rows: list[int], num_seqs: int,
                    eos_token_ids: tuple[int, ...], sharding, num_draft_tokens: int) -> tuple:
    """(presence, frequency, repetition, history rows, prompt lengths, banned tokens, history extra): the plain
    rows' shared arrays, or copies with the special rows (penalties, or banned tokens under min_tokens) filled
    one by one; history extra: see ``_draft_penalties`` (None without speculative decoding)."""
    if not special_rows:
        return *_plain_rows_on_device(num_seqs, sharding), _no_history_extra(num_seqs, num_draft_tokens, sharding)
    arrays = _plain_rows(num_seqs)
    presence, frequency, repetition, history_rows, num_prompt, banned = (a.copy() for a in arrays)
    penalized = []
    for row in special_rows:
        seq, p = scheduled[row].seq, scheduled[row].group.params
        if p.has_penalties:
            presence[row], frequency[row], repetition[row] = (p.presence_penalty, p.frequency_penalty,
                                                              p.repetition_penalty)
            num_prompt[row] = seq.num_prompt_tokens
            penalized.append(row)
        if not reached_min_tokens(seq, p):
            ban = ([] if p.ignore_eos else list(eos_token_ids)) + list(p.stop_token_ids)  # EOS first
            banned[row, :len(ban)] = ban[:MAX_BANNED]
    if penalized:  # their tokens, on the device already but for those new since the last step
        history_rows[penalized] = state.penalty_history.slots([scheduled[row].seq for row in penalized],
                                                              {s.seq for s in scheduled})
    extra = _draft_penalties(scheduled, penalized, [presence, frequency, repetition, history_rows, num_prompt],
                             num_draft_tokens)
    return presence, frequency, repetition, history_rows, num_prompt, banned, extra


def _draft_penalties(scheduled: list[ScheduledSeq], penalized: list[int], per_row: list[np.ndarray],
                     num_draft_tokens: int) -> np.ndarray | None:
    """Speculative decoding with penalties: each draft position's row of a penalized row (the draft rows follow
    the scheduled rows, in order) takes that row's penalty inputs (``per_row``, filled in place), and the history
    extra [S, num_draft_tokens] holds the drafts before each row's position (the speculating row's own: after
    every draft), which the penalties count as output tokens. None without speculative decoding."""
    if not num_draft_tokens:
        return None
    extra = np.full((len(per_row[0]), num_draft_tokens), -1, np.int32)
    at, penalized = len(scheduled), set(penalized)
    for row, s in enumerate(scheduled):
        drafts = list(s.spec_token_ids)
        if drafts and row in penalized:
            extra[row, :len(drafts)] = drafts
            for j in range(len(drafts)):
                for array in per_row:
                    array[at + j] = array[row]
                extra[at + j, :j] = drafts[:j]
        at += len(drafts)
    return extra


@functools.lru_cache(maxsize=64)
def _no_history_extra(num_seqs: int, num_draft_tokens: int, sharding):
    """The history extra of a batch without penalized drafts, on the device(s) once per shape (None without
    speculative decoding)."""
    return put(np.full((num_seqs, num_draft_tokens), -1, np.int32), sharding) if num_draft_tokens else None


@functools.lru_cache(maxsize=64)
def _plain_rows(num_seqs: int) -> tuple[np.ndarray, ...]:
    """Penalty and ban inputs of rows without penalties or bans (the common case), made once per shape."""
    arrays = (np.zeros(num_seqs, np.float32), np.zeros(num_seqs, np.float32), np.ones(num_seqs, np.float32),
              np.zeros(num_seqs, np.int32), np.zeros(num_seqs, np.int32), np.full((num_seqs, MAX_BANNED), -1, np.int32))
    for a in arrays:
        a.flags.writeable = False
    return arrays


@functools.lru_cache(maxsize=64)
def _plain_rows_on_device(num_seqs: int, sharding) -> tuple:
    """``_plain_rows`` on the device(s), once per shape: a step without penalties or bans transfers none."""
    return tuple(put(a, sharding) for a in _plain_rows(num_seqs))


def _bitmask_rows(bitmask: np.ndarray | None, num_seqs: int, config: EngineConfig):
    if bitmask is None:
        return all_allowed(num_seqs, config.model.vocab_size, replicated(config))
    out = np.full((num_seqs, bitmask.shape[1]), -1, np.int32)
    out[:len(bitmask)] = bitmask
    return out
