"""The prefix cache's host and disk tiers (kv_offloading_size, kv_offloading_dir): a tiny random Llama over a
device pool too small for the conversations' prefixes gives the tokens of an engine without the tiers (greedy
and seeded) while restoring blocks instead of computing them; a restarted engine finds the disk tier's blocks;
truncated, corrupt and foreign files are never served. The accounting over every tier is in the property test
(tests/test_block_accounting.py, tests/fake_engine.py). The same conversations over an int8 and an fp8 pool
(an int8 block's scales move with its values) and at tensor_parallel_size=2 on 2 forced CPU devices (a child
pytest: the moves gather and load each device's KV heads) give their own engine's tokens without the tiers."""
from __future__ import annotations

import argparse
import logging
import os
import random
import threading

import numpy as np
import pytest

from jaxpage.core.block_pool import hash_block
from jaxpage.engine.arg_utils import EngineArgs
from jaxpage.engine.config_builder import build_engine_config
from jaxpage.models import config_from_hf
from jaxpage.sampling_params import SamplingParams
from tests.factories import engine_options, run_on_forced_devices, tiny_llama

BLOCK_SIZE = 16
BLOCK_BYTES = 2 * 2 * 2 * BLOCK_SIZE * 16 * 4  # tiny Llama: 2 layers, K and V, 2 KV heads of 16, float32
# a byte a value; int8 adds a float32 scale per token and KV head
QUANTIZED_BLOCK_BYTES = {"int8": 2 * 2 * 2 * BLOCK_SIZE * (16 + 4), "fp8": 2 * 2 * 2 * BLOCK_SIZE * 16}
TP_CHILD = os.environ.get("JAXPAGE_KV_TIERS_TP_CHILD") == "1"
CONVERSATIONS, TURNS, MESSAGE, REPLY = 4, 3, 20, 8
HOST_BLOCKS = 6  # the device pool holds 9 blocks: together not all the conversations' prefixes (4 x 4-5 blocks)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.reference import save_random_model

    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(tiny_llama(), path, seed=random.randrange(2**31))
    return str(path), str(tmp_path_factory.mktemp("cache")), tmp_path_factory.mktemp("kv-disk")


def _llm(tiny, **options):
    from jaxpage import LLM

    path, cache, _ = tiny
    return LLM(path, cache_dir=cache, **engine_options(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                                                       num_kv_blocks=10, **options))


def _params(conversation: int, turn: int) -> SamplingParams:
    if conversation % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=REPLY, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_k=5, seed=100 * conversation + turn, max_tokens=REPLY, ignore_eos=True)


def _messages() -> list[list[list[int]]]:
    rng = np.random.default_rng(11)
    return [[[int(t) for t in rng.integers(0, 256, MESSAGE)] for _ in range(TURNS)] for _ in range(CONVERSATIONS)]


def _chat(llm) -> tuple[list[list[list[int]]], list[list[int]]]:
    """The conversations, interleaved turn by turn, one request at a time: each turn's prompt is the
    conversation so far (prompts and replies) and a new message. Returns each turn's reply, and the last turn's
    prompts."""
    messages, history = _messages(), [[] for _ in range(CONVERSATIONS)]
    replies = [[] for _ in range(CONVERSATIONS)]
    last_prompts = []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            prompt = history[c] + messages[c][turn]
            if turn == TURNS - 1:
                last_prompts.append(prompt)
            (out,) = llm.generate([{"prompt_token_ids": prompt}], _params(c, turn), use_tqdm=False)
            replies[c].append(list(out.outputs[0].token_ids))
            history[c] = prompt + replies[c][-1]
    return replies, last_prompts


def _computed(stats: dict) -> int:
    """Prompt tokens the engine computed: looked up, less those found on the device or in a tier."""
    return stats["prefix_cache_queries"] - stats["prefix_cache_hits"] - stats.get("external_prefix_cache_hits", 0)


def _with_and_without_tiers(tiny, directory, block_bytes: int = BLOCK_BYTES, **options):
    """The conversations on an engine without tiers and on one with a host tier of 6 blocks over the disk tier in
    ``directory`` (so both serve): (replies without, replies with, the last turn's prompts, stats without, with)."""
    plain = _llm(tiny, **options)
    expected, last_prompts = _chat(plain)
    tiered = _llm(tiny, kv_offloading_size=HOST_BLOCKS * block_bytes / 2**30, kv_offloading_dir=str(directory),
                  **options)
    got, _ = _chat(tiered)
    tiered.engine.close()  # the disk tier's queued writes in place (a restarted engine reads them)
    return expected, got, last_prompts, plain.stats(), tiered.stats()


def _assert_restored_exactly(expected, got, plain: dict, tiered: dict, block_bytes: int) -> None:
    """The tiered engine's replies are the plain one's, both tiers served, and it computed exactly the restored
    tokens fewer."""
    assert got == expected  # greedy (even conversations) and seeded sampling (odd ones), turn by turn
    assert tiered["kv_offload_host_hits"] > 0 and tiered["kv_offload_disk_hits"] > 0, tiered
    assert tiered["kv_offload_restores"] == tiered["kv_offload_host_hits"] + tiered["kv_offload_disk_hits"]
    assert tiered["kv_offload_host_hit_bytes"] == tiered["kv_offload_host_hits"] * block_bytes
    assert tiered["kv_offload_stores"] > 0 and tiered["kv_offload_disk_writes"] > 0
    assert tiered["kv_offload_dropped"] == 0  # no block left the device while every host slot was pinned
    assert tiered["kv_offload_disk_write_seconds"] > 0  # the writer thread's
    assert tiered["external_prefix_cache_hits"] == tiered["kv_offload_restores"] * BLOCK_SIZE
    assert tiered["prefix_cache_queries"] == plain["prefix_cache_queries"]
    assert _computed(tiered) == _computed(plain) - tiered["external_prefix_cache_hits"] < _computed(plain)
    assert tiered["num_free_blocks"] == tiered["num_blocks"] and plain["num_free_blocks"] == plain["num_blocks"]


@pytest.fixture(scope="module")
def runs(tiny):
    """The float32 pool's conversations without and with the tiers (the disk tier in the module's directory)."""
    return _with_and_without_tiers(tiny, tiny[2])


def test_tiers_give_the_same_tokens_and_compute_fewer_prompt_tokens(runs):
    expected, got, _, plain, tiered = runs
    _assert_restored_exactly(expected, got, plain, tiered, BLOCK_BYTES)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_tiers_over_a_quantized_pool_give_its_tokens(tiny, tmp_path, kv_cache_dtype):
    block_bytes = QUANTIZED_BLOCK_BYTES[kv_cache_dtype]
    expected, got, _, plain, tiered = _with_and_without_tiers(tiny, tmp_path, block_bytes,
                                                              kv_cache_dtype=kv_cache_dtype)
    _assert_restored_exactly(expected, got, plain, tiered, block_bytes)
    assert tiered["kv_offload_disk_hit_bytes"] == tiered["kv_offload_disk_hits"] * block_bytes


@pytest.mark.skipif(TP_CHILD, reason="the parent's test")
def test_tiers_under_tensor_parallelism_on_two_cpu_devices():
    run_on_forced_devices(f"{__file__}::test_tp2_tiers_give_tp2s_tokens", 2, "JAXPAGE_KV_TIERS_TP_CHILD")


if TP_CHILD:
    def test_tp2_tiers_give_tp2s_tokens(tiny, tmp_path):
        import jax

        assert len(jax.devices()) == 2, jax.devices()
        expected, got, _, plain, tiered = _with_and_without_tiers(tiny, tmp_path, tensor_parallel_size=2)
        _assert_restored_exactly(expected, got, plain, tiered, BLOCK_BYTES)


def test_a_restarted_engine_finds_the_disk_tier_and_serves_no_bad_file(runs, tiny, caplog):
    """A fresh engine over the same directory, sent each conversation's last prompt again: conversation 3's
    restores its blocks from disk; conversations 0-2's first blocks are made corrupt, truncated and foreign
    (another model's weights in the header): each is logged, deleted and computed instead (its block may be
    written again later, from the recomputed K/V); every reply is the engine-without-tiers' one."""
    expected, _, last_prompts, _, _ = runs
    directory = tiny[2]
    paths = [directory / (hash_block(None, p[:BLOCK_SIZE]).hex() + ".kvblock") for p in last_prompts]
    assert all(p.is_file() for p in paths), "the first run left the conversations' first blocks on disk"
    corrupt = bytearray(paths[0].read_bytes())
    corrupt[-1] ^= 0xFF
    paths[0].write_bytes(bytes(corrupt))
    paths[1].write_bytes(paths[1].read_bytes()[:-100])
    foreign = paths[2].read_bytes()
    at = foreign.index(b'"weights": "') + len(b'"weights": "')
    paths[2].write_bytes(foreign[:at] + (b"0" if foreign[at:at + 1] != b"0" else b"1") + foreign[at + 1:])
    restarted = _llm(tiny, kv_offloading_size=HOST_BLOCKS * BLOCK_BYTES / 2**30, kv_offloading_dir=str(directory))
    with caplog.at_level(logging.WARNING, logger="jaxpage.worker.kv_disk_store"):
        for c in range(CONVERSATIONS):
            (out,) = restarted.generate([{"prompt_token_ids": last_prompts[c]}], _params(c, TURNS - 1),
                                        use_tqdm=False)
            assert list(out.outputs[0].token_ids) == expected[c][-1], c
    stats = restarted.stats()
    assert stats["kv_offload_disk_rejected"] == 3 and stats["kv_offload_disk_failed"] == 3
    reasons = [r.getMessage() for r in caplog.records]
    assert any("checksum" in m for m in reasons) and any("truncated" in m for m in reasons)
    assert any("another model" in m for m in reasons), reasons
    disk = restarted.engine.runner.disk_store  # a bad file was deleted; one there now was written afresh, and is good
    hashes = [hash_block(None, p[:BLOCK_SIZE]) for p in last_prompts[:3]]
    assert all(not p.exists() or disk.read(h) is not None for p, h in zip(paths, hashes))
    assert disk.rejected == 3
    assert stats["kv_offload_disk_hits"] >= 1  # conversation 3's blocks
    assert stats["kv_offload_disk_hit_bytes"] == stats["kv_offload_disk_hits"] * BLOCK_BYTES


def test_offloading_options_take_vllm_flags_and_refuse_bad_values():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-offloading-size", "512MiB", "--kv-offloading-backend",
                                                       "native", "--kv-offloading-dir", "/tmp/x"]))
    assert args.kv_offloading_size == 0.5 and args.kv_offloading_dir == "/tmp/x"
    assert EngineArgs.from_cli_args(parser.parse_args(["--kv-offloading-size", "4"])).kv_offloading_size == 4.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-offloading-backend", "lmcache"])
    model = config_from_hf(tiny_llama())
    options = dict(dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=None, num_kv_blocks=10, max_num_seqs=4,
                   max_num_batched_tokens=32, max_model_len=128, gpu_memory_utilization=0.9)
    config = build_engine_config(model, **options, kv_offloading_size=64 * BLOCK_BYTES / 2**30)
    assert config.cache.num_offload_blocks == 64 and config.cache.kv_offloading_dir is None
    for bad, field in ((dict(kv_offloading_dir="/tmp/x"), "kv_offloading_dir"),
                       (dict(kv_offloading_size=-1.0), "kv_offloading_size"),
                       (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "kv_offloading_size"),
                       (dict(kv_offloading_size=1e-9), "kv_offloading_size")):
        with pytest.raises(ValueError, match=field):
            build_engine_config(model, **options, **bad)


def test_disk_index_keeps_its_capacity_dropping_the_least_recently_used(tmp_path):
    """The scheduler's index holds at most its capacity, pushing out the least recently used (a read touches);
    the store deletes what it is told; a restarted index over the files keeps the most recently used ones (a read
    touches its file too), and a store written for another model serves no file of the directory."""
    import os

    from jaxpage.core.kv_disk_index import DiskKVIndex
    from jaxpage.worker.kv_disk_store import DiskKVStore

    leaves = [(np.float32, (4, 8))]
    store, index = DiskKVStore(tmp_path / "d", {"model": "m"}, leaves), DiskKVIndex(3)
    blocks = [np.full((4, 8), i, np.float32) for i in range(4)]
    hashes = [bytes([i]) * 16 for i in range(4)]
    for i in range(3):
        assert index.add(hashes[i]) == []
        store.write(hashes[i], [blocks[i]])
        store.flush()
        os.utime(store.path(hashes[i]), (1000.0 * (i + 1), 1000.0 * (i + 1)))
    index.touch(hashes[0])
    assert np.array_equal(store.read(hashes[0])[0], blocks[0])  # its file now the most recently used
    assert index.add(hashes[3]) == [hashes[1]] and list(index) == [hashes[2], hashes[0], hashes[3]]
    store.write(hashes[3], [blocks[3]])
    store.delete(hashes[1])
    store.flush()
    assert sorted(store.stored()) == sorted([hashes[0], hashes[2], hashes[3]])
    assert store.num_bytes == 3 * store.file_bytes == sum(p.stat().st_size for p in (tmp_path / "d").iterdir())
    restarted = DiskKVIndex(2, store.stored())
    assert restarted.evicted == [hashes[2]] and set(restarted) == {hashes[0], hashes[3]}
    with pytest.raises(ValueError, match="capacity"):
        DiskKVIndex(0)
    other = DiskKVStore(tmp_path / "d", {"model": "another"}, leaves)  # same directory, other model
    assert other.read(hashes[0]) is None and other.rejected == 1 and not other.path(hashes[0]).exists()


def test_no_file_is_read_while_scheduling(tmp_path, monkeypatch):
    """Over the fake runner with a disk tier: prompts whose prefixes come back from disk; the store's reads all
    happen in the runner's moves, none inside the scheduler's pass (the index answers there)."""
    from jaxpage.worker.kv_disk_store import DiskKVStore
    from tests.fake_engine import check_all_free, make_engine, run_checked

    engine = make_engine(num_kv_blocks=9, max_num_seqs=2, num_offload_blocks=2, offload_disk=str(tmp_path),
                         async_scheduling=False)
    scheduling, reads = [False], []
    schedule = engine.scheduler.schedule

    def marked_schedule():
        scheduling[0] = True
        try:
            return schedule()
        finally:
            scheduling[0] = False

    read = DiskKVStore.read
    monkeypatch.setattr(engine.scheduler, "schedule", marked_schedule)
    monkeypatch.setattr(DiskKVStore, "read", lambda self, h: reads.append(scheduling[0]) or read(self, h))
    rng = np.random.default_rng(4)
    prefixes = [[int(t) for t in rng.integers(1, 24, 24)] for _ in range(3)]
    for r in range(3):
        for i, prefix in enumerate(prefixes):
            engine.add_request(f"r{r}-{i}", {"prompt_token_ids": prefix + [int(t) for t in rng.integers(1, 24, 5)]},
                               SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            run_checked(engine)
    check_all_free(engine)
    assert engine.kv.offload.disk_hits > 0 and reads and not any(reads), reads


def test_a_queued_write_is_served_before_its_file_is_in_place_and_close_flushes(tmp_path, monkeypatch):
    """The writer thread held: written blocks (an int8 block's values and scales) are not on disk yet, but the
    store reads them back from its copies, though the caller has reused its arrays; close lets every file land,
    and a fresh store over the directory reads them."""
    from jaxpage.worker.kv_disk_store import DiskKVStore

    gate, write_file = threading.Event(), DiskKVStore._write_file
    monkeypatch.setattr(DiskKVStore, "_write_file", lambda self, *args: gate.wait(30) and write_file(self, *args))
    rng = np.random.default_rng(5)
    leaves = [(np.int8, (2, 4, 8)), (np.float32, (2, 4))]
    tier = DiskKVStore(tmp_path, {"model": "m"}, leaves)
    blocks = [[rng.integers(-128, 128, (2, 4, 8)).astype(np.int8), rng.random((2, 4), np.float32)] for _ in range(3)]
    expected = [[a.copy() for a in block] for block in blocks]
    hashes = [bytes([i]) * 16 for i in range(3)]
    for block_hash, block in zip(hashes, blocks):
        tier.write(block_hash, block)
        for a in block:
            a[...] = 0  # the host arena's slot takes another block
    assert not list(tmp_path.iterdir())
    for block_hash, block in zip(hashes, expected):
        assert all(np.array_equal(got, want) for got, want in zip(tier.read(block_hash), block))
    gate.set()
    tier.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(h.hex() + ".kvblock" for h in hashes)
    assert tier.num_bytes == sum(p.stat().st_size for p in tmp_path.iterdir()) and tier.write_seconds > 0
    fresh = DiskKVStore(tmp_path, {"model": "m"}, leaves)
    for block_hash, block in zip(hashes, expected):
        assert all(np.array_equal(got, want) for got, want in zip(fresh.read(block_hash), block))
    assert fresh.rejected == 0


def test_a_failed_disk_write_is_logged_and_the_tier_goes_on(tmp_path, caplog):
    """The directory gone under a queued write: the write is logged, the block not kept (no error reaches the
    caller, whose step must go on), and once the directory is back the next write lands."""
    import shutil

    from jaxpage.worker.kv_disk_store import DiskKVStore

    leaves = [(np.float32, (4, 8))]
    tier = DiskKVStore(tmp_path / "d", {"model": "m"}, leaves)
    shutil.rmtree(tmp_path / "d")
    with caplog.at_level("WARNING"):
        tier.write(b"a" * 16, [np.ones((4, 8), np.float32)])
        tier.flush()
    assert "not written" in caplog.text and tier.read(b"a" * 16) is None
    (tmp_path / "d").mkdir()
    tier.write(b"b" * 16, [np.full((4, 8), 2, np.float32)])
    tier.close()
    assert np.array_equal(tier.read(b"b" * 16)[0], np.full((4, 8), 2, np.float32))


def _rounds_with_and_without_tiers(seed: int, damage: bool = False, **options):
    """Prompts on three prefixes of 3 blocks, sent round after round (each request run to its end) through the fake
    runner's pool of 9 blocks, without the tiers and with a host tier of 2 over the disk tier (``damage``: every
    disk file corrupted or deleted before each later round); returns both engines' outputs and the tiered engine,
    every block and host slot checked back."""
    from tests.fake_engine import check_all_free, damage_a_disk_file, make_engine, run_checked

    rng = np.random.default_rng(seed)
    prefixes = [[int(t) for t in rng.integers(1, 24, 24)] for _ in range(3)]
    rounds = [[p + [int(t) for t in rng.integers(1, 24, 5)] for p in prefixes] for _ in range(3)]
    outputs = []
    for tiers in (False, True):
        engine = make_engine(num_kv_blocks=9, max_num_seqs=2, num_offload_blocks=2 if tiers else 0,
                             offload_disk=tiers, **options)
        done = {}
        for r, prompts in enumerate(rounds):
            if damage and tiers and r:
                store = engine.runner.disk_store
                for pick in range(len(list(store.directory.glob("*.kvblock")))):
                    damage_a_disk_file(store, pick)  # corrupt, delete, corrupt, ...
            for i, prompt in enumerate(prompts):
                engine.add_request(f"r{r}-{i}", {"prompt_token_ids": prompt},
                                   SamplingParams(temperature=0.0, seed=1, max_tokens=6, ignore_eos=True))
                done.update(run_checked(engine))
        check_all_free(engine)
        outputs.append({rid: out.outputs[0].token_ids for rid, out in done.items()})
    return outputs, engine


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fake_runner_restores_from_both_tiers_exactly(window, mode):
    """Over the block-accounting fake runner (its simulated K/V checked at every read), with every layer sliding
    (window 20) or not, swap preemption beside the tiers or not: both tiers serve, the outputs are those of an
    engine without the tiers, and every block and host slot comes back."""
    (plain, tiered), engine = _rounds_with_and_without_tiers(
        3, mode=mode, num_host_blocks=4 if mode == "swap" else 0, window=window, async_scheduling=False)
    assert tiered == plain
    c = engine.kv.offload
    assert c.host_hits > 0 and c.disk_hits > 0 and c.stores > 0, c


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_disk_load_is_computed_instead(async_scheduling):
    """Over the fake runner: prefixes sent to the disk tier, then every file corrupted or deleted behind the
    engine's back. Each restore queued from the index fails in the runner's moves; the requests holding those
    blocks go back to compute them (no step reads a failed block: the fake checks every read), the outputs are
    an engine-without-tiers', and every block comes back."""
    (plain, tiered), engine = _rounds_with_and_without_tiers(6, damage=True, async_scheduling=async_scheduling)
    assert tiered == plain
    assert engine.kv.offload.disk_failed > 0 and engine.runner.disk_store.rejected > 0, engine.kv.offload


def test_a_closed_engine_leaves_its_prefix_cache_for_a_restart(tiny, tmp_path):
    """One prompt on the tiny model with the tiers (nothing evicted: before the write-through and the flush at
    close, the disk held nothing then), LLM used as a context manager; a fresh LLM over the same directory computes
    only the last, partial block's tokens: the full blocks come from disk, and the reply is the same."""
    prompt = [int(t) for t in np.random.default_rng(8).integers(0, 256, 3 * BLOCK_SIZE + 5)]
    params = SamplingParams(temperature=0.0, max_tokens=REPLY, ignore_eos=True)
    options = dict(kv_offloading_size=HOST_BLOCKS * BLOCK_BYTES / 2**30, kv_offloading_dir=str(tmp_path))
    with _llm(tiny, **options) as first:
        (out,) = first.generate([{"prompt_token_ids": prompt}], params)
        assert first.stats()["kv_offload_disk_hits"] == 0
    assert len(list(tmp_path.glob("*.kvblock"))) >= 3
    with _llm(tiny, **options) as restarted:
        (again,) = restarted.generate([{"prompt_token_ids": prompt}], params)
        stats = restarted.stats()
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert stats["kv_offload_disk_hits"] == 3 and _computed(stats) == 5, stats


def test_the_write_through_is_bounded_and_a_flush_writes_the_rest():
    """Over the fake runner: a 6-block prompt with a write-through of 2 blocks a step queues 2 for disk; close
    writes every cached block the disk lacks, the host tier's too, and the files are then the index's."""
    from tests.fake_engine import BLOCK_SIZE as FAKE_BLOCK_SIZE
    from tests.fake_engine import make_engine, run_checked

    engine = make_engine(num_kv_blocks=12, max_num_seqs=2, num_offload_blocks=2, offload_disk=True,
                         async_scheduling=False)
    engine.kv.disk_stores_per_step = 2
    engine.add_request("a", {"prompt_token_ids": [t % 20 + 1 for t in range(6 * FAKE_BLOCK_SIZE + 1)]},
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    run_checked(engine)
    stores = [m for m in engine.runner.moves if m[0] == "disk_store"]
    assert 2 <= len(stores) < 6, stores
    store, index = engine.runner.disk_store, engine.kv.disk_index
    engine.close()
    on_disk = {bytes.fromhex(p.name[:-len(".kvblock")]) for p in store.directory.glob("*.kvblock")}
    cached = {h for h, _ in engine.block_pool.cached_blocks()} | {h for h, _ in engine.kv.host_tier.blocks()}
    assert cached <= on_disk == set(index) and len(on_disk) >= 6
