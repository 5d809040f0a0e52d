"""Several processes (hosts), one mesh: ``jax.distributed`` over every process's devices.

Process 0 runs the scheduler and the servers; every other process runs ``follow``: the same compiled device
calls (steps, block copies and swaps) on the inputs process 0 decides. Before each call the leader's runner
(``LeaderRunner``) broadcasts one message of a fixed size (``multihost_utils.broadcast_one_to_all``): a header
(what comes, its bucket) and the call's small host arrays, packed as bytes; a step's penalty table or bitmask,
when it has one, follows in a broadcast of its own. So every process makes the same calls in the same order, as
multi-controller JAX requires. A STOP message ends the followers once process 0's engine has stopped.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import SingleDeviceSharding

from jaxpage.core.kv_cache_manager import COPY, SWAP_IN, SWAP_OUT
from jaxpage.distributed.parallel import put
from jaxpage.worker.model_runner import ModelRunner
from jaxpage.worker.penalty_history import PenaltyHistory
from jaxpage.worker.step import abstract_step_inputs, all_allowed, replicated

log = logging.getLogger(__name__)

STEP, MOVE, STOP = 1, 2, 3
MOVE_KINDS = (COPY, SWAP_OUT, SWAP_IN)
ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


@dataclasses.dataclass
class DistributedArgs:
    """``jax.distributed.initialize``'s options; unset ones come from the environment (``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``); without any of them the process runs alone, and with some, JAX's
    cluster detection (SLURM, Open MPI, Cloud TPU, ...) fills in the rest."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--coordinator-address", default=None,
                            help="host:port of process 0's coordinator, for a mesh over several processes (hosts)")
        parser.add_argument("--num-processes", type=int, default=None, help="processes in the mesh")
        parser.add_argument("--process-id", type=int, default=None,
                            help="this process's index; 0 serves, the others follow its steps")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "DistributedArgs":
        def value(name):
            given = getattr(ns, name, None)
            if given is None and os.environ.get(ENV[name]):
                given = os.environ[ENV[name]]
                return given if name == "coordinator_address" else _int(ENV[name], given)
            return given
        return cls(**{name: value(name) for name in ENV})

    @property
    def requested(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be an integer") from None


def initialize(args: DistributedArgs) -> None:
    """Joins the processes into one runtime (before anything touches a JAX backend); nothing without options."""
    if not args.requested:
        return
    if args.num_processes is not None and args.num_processes < 1:
        raise ValueError(f"--num-processes={args.num_processes} must be >= 1")
    if args.process_id is not None and args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id={args.process_id} must be in [0, --num-processes={args.num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on CPU devices
    jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    log.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    """Process 0: the one that schedules, serves and broadcasts."""
    return jax.process_index() == 0


def runner_class() -> type[ModelRunner]:
    """The runner this process's engine uses: the broadcasting one on process 0 of several."""
    return LeaderRunner if is_multiprocess() and is_leader() else ModelRunner


HEADER = 5  # int32s opening every message: the kind, then its values


def _header(kind: int = 0, *values: int) -> np.ndarray:
    header = np.zeros(HEADER, np.int32)
    header[:1 + len(values)] = (kind, *values)
    return header


def _pack(tree) -> np.ndarray:
    """The bytes of ``tree``'s arrays, one after the other."""
    leaves = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in jax.tree.leaves(tree)]
    return np.concatenate(leaves) if leaves else np.zeros(0, np.uint8)


def _unpack(data: np.ndarray, like):
    """``like``'s arrays (shapes and dtypes) read from ``data``'s bytes, as ``_pack`` wrote them."""
    leaves, treedef = jax.tree.flatten(like)
    offsets = np.cumsum([0] + [a.nbytes for a in leaves])
    return jax.tree.unflatten(treedef, [data[lo:hi].view(a.dtype).reshape(a.shape)
                                        for a, lo, hi in zip(leaves, offsets, offsets[1:])])


def _broadcast(tree, is_source: bool):
    """``tree``'s arrays (the same shapes and dtypes on every process) as process 0 has them, in one broadcast
    of their bytes: each array broadcast apart costs a collective of its own (about 2.5 ms on a CPU)."""
    return _unpack(multihost_utils.broadcast_one_to_all(_pack(tree), is_source=is_source), tree)


def message_size(config) -> int:
    """Bytes of every message: a header and the largest payload (the largest bucket's step inputs, or a block
    move's source and destination ids), so that one broadcast of a fixed shape carries each call."""
    step = _step_payload(config, config.token_buckets()[-1], False, False)
    return 4 * HEADER + max(_pack(step).nbytes, 2 * 4 * config.scheduler.max_num_seqs)


def _send(size: int, header: np.ndarray, payload=()) -> None:
    message = np.zeros(size, np.uint8)
    data = _pack((header, payload))
    message[:len(data)] = data
    multihost_utils.broadcast_one_to_all(message, is_source=True)


def _receive(size: int) -> tuple[list[int], np.ndarray]:
    """The next message: its header's values and the bytes of its payload."""
    message = multihost_utils.broadcast_one_to_all(np.zeros(size, np.uint8), is_source=False)
    return [int(v) for v in message[:4 * HEADER].view(np.int32)], message[4 * HEADER:]


def _step_payload(config, num_tokens: int, has_history: bool, has_bitmask: bool):
    """Zeros shaped as a step's (batch, sampling) host arrays; None for those not sent (the penalty history
    unless a row has penalties, the bitmask unless a row is constrained: each then follows in a broadcast of
    its own; want_top: in the header)."""
    batch, sampling = abstract_step_inputs(config, num_tokens)
    sampling = dataclasses.replace(sampling, want_top=None, history=sampling.history if has_history else None,
                                   allowed=sampling.allowed if has_bitmask else None)
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), (batch, sampling))


def _split(sampling):
    """(sampling without the history and bitmask, (history, bitmask)): the fixed message's part and the rest."""
    return dataclasses.replace(sampling, history=None, allowed=None), (sampling.history, sampling.allowed)


def _complete(config, batch, sampling, want_top: int, empty_history: jax.Array):
    """A received step's inputs with what was not sent: the all -1 history, the all-allowed bitmask."""
    num_seqs = batch.block_tables.shape[0]
    if sampling.history is None:
        sampling = dataclasses.replace(sampling, history=empty_history)
    if sampling.allowed is None:
        sampling = dataclasses.replace(sampling, allowed=all_allowed(num_seqs, config.model.vocab_size,
                                                                     replicated(config)))
    return batch, dataclasses.replace(sampling, want_top=np.bool_(want_top))


class LeaderRunner(ModelRunner):
    """Process 0's runner: each device call is broadcast to the followers first."""

    supports_async_scheduling = False  # the followers replay host arrays: a step's token ids must be on the host

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The penalty table is kept on a device of this process only (its updates are not followers' calls) and
        # sent with the steps that read it
        config = self.config
        self.input_batch.penalty_history = PenaltyHistory(config.scheduler.max_num_seqs, config.scheduler.max_model_len,
                                                          SingleDeviceSharding(jax.local_devices()[0]),
                                                          1 + config.num_draft_tokens)
        self._empty_history = empty_history(config)
        self._message_size = message_size(config)

    def move(self, kind: str, src: np.ndarray, dst: np.ndarray, n: int) -> None:
        _send(self._message_size, _header(MOVE, MOVE_KINDS.index(kind), n), np.stack([src, dst]).astype(np.int32))
        super().move(kind, src, dst, n)

    def run(self, batch, sampling):
        has_history = bool(np.any(np.asarray(sampling.history_rows)))
        has_bitmask = isinstance(sampling.allowed, np.ndarray)
        want_top = int(sampling.want_top)
        fixed, _ = _split(dataclasses.replace(sampling, want_top=None))
        _send(self._message_size, _header(STEP, batch.token_ids.shape[0], has_history, has_bitmask, want_top),
              (batch, fixed))
        history, allowed = (_broadcast(np.asarray(sampling.history), True) if has_history else None,
                            _broadcast(sampling.allowed, True) if has_bitmask else None)
        sampling = dataclasses.replace(fixed, history=history, allowed=allowed)
        return super().run(*_complete(self.config, batch, sampling, want_top, self._empty_history))

    def stop_followers(self) -> None:
        """Once this engine has stopped: ends every follower's loop."""
        _send(self._message_size, _header(STOP))


def empty_history(config) -> jax.Array:
    """The penalty table of steps without penalties (all -1), made by every process alike."""
    rows = (config.scheduler.max_num_seqs + 1, config.scheduler.max_model_len)
    return put(np.full(rows, -1, np.int32), replicated(config))


def follow(runner: ModelRunner) -> int:
    """A follower process's loop: the leader's device calls, until it says STOP; returns the exit code 0."""
    config, history = runner.config, empty_history(runner.config)
    size = message_size(config)
    log.info("process %d following process 0's steps", jax.process_index())
    while True:
        (kind, *values), payload = _receive(size)
        if kind == STOP:
            log.info("process %d: stop from process 0", jax.process_index())
            return 0
        if kind == MOVE:
            move_kind, n = MOVE_KINDS[values[0]], values[1]
            src, dst = _unpack(payload, np.zeros((2, config.scheduler.max_num_seqs), np.int32))
            runner.move(move_kind, src, dst, n)
        elif kind == STEP:
            num_tokens, has_history, has_bitmask, want_top = values
            batch, sampling = _unpack(payload, _step_payload(config, num_tokens, False, False))
            template = _step_payload(config, num_tokens, has_history, has_bitmask)[1]
            sampling = dataclasses.replace(
                sampling, history=_broadcast(template.history, False) if has_history else None,
                allowed=_broadcast(template.allowed, False) if has_bitmask else None)
            jax.block_until_ready(runner.run(*_complete(config, batch, sampling, want_top, history)))
        else:
            raise RuntimeError(f"follower: unknown message {kind} from process 0")
