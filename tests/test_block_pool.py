"""The block pool: each block handed out once, never the null block."""
from __future__ import annotations

import pytest

from jaxpage.attention.kv_cache import NULL_BLOCK
from jaxpage.core.block_pool import BlockPool


def test_block_pool_hands_out_each_block_once_and_never_the_null_block():
    pool = BlockPool(9)
    blocks = pool.allocate(8)
    assert sorted(blocks) == list(range(1, 9)) and NULL_BLOCK not in blocks
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.share(blocks[:2])
    pool.free(blocks)
    assert pool.num_free == 6  # the two forked blocks still have an owner
    pool.free(blocks[:2])
    assert pool.num_free == 8 and pool.peak_used == 8
    with pytest.raises(AssertionError):
        pool.free(blocks[:1])
