"""The worker's side of the prefix cache's disk tier (vLLM's connector roles: the scheduler's side is
core/kv_disk_index.py, which decides what is written, read and deleted): one file per block, named by its
chained prefix hash, so a restarted engine with the same directory finds the blocks again. Each file is a header
(magic, the identity of the model and the KV format it was written for, the payload's length and CRC-32) and the
block's arrays. A file that is truncated, corrupt or written for another model or format is never served: ``read``
logs it, deletes it and answers None, and the runner reports the block whose restore failed.

Writes and deletes run in order on one writer thread, so a step never waits for a file: ``write`` copies the block
and queues it (at most ``max_queued`` blocks; past that it waits for the oldest), and until its file is in place
(renamed: a reader never sees half a file) ``read`` answers from the queued copy. ``close`` (or ``flush``) waits
for the queue."""
from __future__ import annotations

import collections
import json
import logging
import os
import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"JAXPAGEKV1\n"
SUFFIX = ".kvblock"


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


class DiskKVStore:
    """identity: what the K/V depend on (model, weights' fingerprint, dtype, block size, layout), stored in every
    header and required equal on read; leaves: each array of a block, (dtype, shape), as the pool holds them."""

    def __init__(self, directory: str | os.PathLike, identity: dict, leaves: list[tuple[np.dtype, tuple[int, ...]]],
                 max_queued: int = 64):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.leaves = [(np.dtype(d), tuple(s)) for d, s in leaves]
        self.identity = {**identity, "leaves": [[d.str, list(s)] for d, s in self.leaves]}
        self._header = json.dumps(self.identity, sort_keys=True).encode()
        self.payload_bytes = sum(d.itemsize * int(np.prod(s)) for d, s in self.leaves)
        self.file_bytes = len(MAGIC) + 4 + len(self._header) + 12 + self.payload_bytes
        self.num_bytes = sum(p.stat().st_size for p in self.directory.glob("*" + SUFFIX))
        self.rejected = 0  # files found bad (truncated, corrupt, foreign) and deleted
        self.read_seconds = self.write_seconds = 0.0  # write_seconds: the writer thread's
        self.writes = 0
        self.dropped = 0  # write-through blocks not written: the writer was behind
        self.max_queued = max_queued
        self._lock = threading.Lock()  # num_bytes and _queued, shared with the writer thread
        self._queued: dict[bytes, list[np.ndarray]] = {}  # blocks whose file is not in place yet
        self._writes: collections.deque[Future] = collections.deque()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxpage-kv-disk-writer")

    def path(self, block_hash: bytes) -> Path:
        return self.directory / (block_hash.hex() + SUFFIX)

    def stored(self) -> list[bytes]:
        """The hashes of the blocks in the directory, least recently written first (their files' names and
        mtimes only: a file is checked when it is read)."""
        found = []
        for p in self.directory.glob("*" + SUFFIX):
            try:
                found.append((p.stat().st_mtime, bytes.fromhex(p.name[:-len(SUFFIX)])))
            except (OSError, ValueError):  # gone meanwhile, or not a name this store writes
                continue
        return [block_hash for _, block_hash in sorted(found)]

    def read(self, block_hash: bytes) -> list[np.ndarray] | None:
        """The block's arrays, checked (or its queued copy); None (logged, the file deleted) if it is missing or
        bad."""
        with self._lock:
            queued = self._queued.get(block_hash)
        if queued is not None:
            return queued
        started, path = time.perf_counter(), self.path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            log.warning("KV disk tier: block %s is not on disk", block_hash.hex()[:16])
            return None
        arrays, why = self._parse(data)
        if why:
            log.warning("KV disk tier: ignoring %s: %s", path, why)
            self.rejected += 1
            self._remove(path)
        else:
            _touch(path)  # most recently used, for the index a restarted engine builds (stored)
        self.read_seconds += time.perf_counter() - started
        return arrays

    def _parse(self, data: bytes) -> tuple[list[np.ndarray] | None, str]:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            return None, "not a KV block file"
        at = len(MAGIC)
        (header_len,) = struct.unpack_from("<I", data, at)
        at += 4
        header = data[at:at + header_len]
        at += header_len
        if header != self._header:
            return None, "written for another model or KV format"
        if len(data) != at + 12 + self.payload_bytes:
            return None, f"{len(data)} bytes, {at + 12 + self.payload_bytes} expected (truncated?)"
        length, crc = struct.unpack_from("<QI", data, at)
        payload = memoryview(data)[at + 12:]
        if length != self.payload_bytes or zlib.crc32(payload) != crc:
            return None, "checksum mismatch (corrupt)"
        arrays, offset = [], 0
        for dtype, shape in self.leaves:
            size = dtype.itemsize * int(np.prod(shape))
            arrays.append(np.frombuffer(payload[offset:offset + size], dtype).reshape(shape))
            offset += size
        return arrays, ""

    def write(self, block_hash: bytes, arrays: list[np.ndarray], wait: bool = True) -> bool:
        """Queues a block's write on the writer thread (a copy: the caller may reuse its arrays); with
        ``wait=False`` drops it, returning False, rather than wait while the queue is full."""
        self._reap(self.max_queued)
        if not wait and len(self._writes) >= self.max_queued:
            self.dropped += 1
            return False
        copies = [np.array(a, d) for a, (d, _) in zip(arrays, self.leaves)]
        with self._lock:
            self._queued[block_hash] = copies
        self._submit(self._write_file, block_hash, copies)
        return True

    def delete(self, block_hash: bytes) -> None:
        """Queues a block's file for deletion, after the writes queued before it."""
        self._submit(lambda: self._remove(self.path(block_hash)))

    def flush(self) -> None:
        """Waits until every queued write and delete is done (a failed write's error is raised here)."""
        self._reap(0)

    def close(self) -> None:
        """Flushes the queue and stops the writer thread."""
        self.flush()
        self._writer.shutdown()

    def _submit(self, work, *args) -> None:
        self._reap(self.max_queued - 1)
        self._writes.append(self._writer.submit(work, *args))

    def _reap(self, keep: int) -> None:
        """Drops the finished work, waiting for the oldest while more than ``keep`` are left."""
        while self._writes and (self._writes[0].done() or len(self._writes) > keep):
            self._writes.popleft().result()

    def _write_file(self, block_hash: bytes, arrays: list[np.ndarray]) -> None:
        """The writer thread: the file written atomically (a temporary file renamed). A file system error (a full
        disk, the directory gone) is logged and the block not kept: the tier is a cache, and a failed write must
        not stop the engine (a later read of it fails, and its blocks are computed)."""
        started, path = time.perf_counter(), self.path(block_hash)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            payload = b"".join(a.tobytes() for a in arrays)
            assert len(payload) == self.payload_bytes
            existed = path.exists()
            tmp.write_bytes(MAGIC + struct.pack("<I", len(self._header)) + self._header
                            + struct.pack("<QI", len(payload), zlib.crc32(payload)) + payload)
            os.replace(tmp, path)
            if not existed:
                with self._lock:
                    self.num_bytes += self.file_bytes
            self.writes += 1
        except OSError as e:
            log.warning("KV disk tier: block %s not written (%s)", block_hash.hex()[:16], e)
            tmp.unlink(missing_ok=True)
        finally:
            with self._lock:
                if self._queued.get(block_hash) is arrays:
                    del self._queued[block_hash]
            self.write_seconds += time.perf_counter() - started

    def _remove(self, path: Path) -> None:
        try:
            size = path.stat().st_size
            path.unlink()
            with self._lock:
                self.num_bytes -= size
        except OSError:
            pass
