"""The vocabulary-sharded argmax against jnp.argmax."""
from __future__ import annotations


def test_vocabulary_argmax_is_jnp_argmax_with_ties_and_masked_rows():
    """The sampler's argmax (a max, then the least id at it) against ``jnp.argmax`` on rows with many ties and
    -inf entries (banned or masked tokens; a row wholly masked gives 0, as ``jnp.argmax``); a NaN row gives an id
    in range."""
    import jax.numpy as jnp
    import numpy as np
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from jaxpage.distributed.vocab_shard import VocabShard

    @settings(max_examples=60, deadline=None)
    @given(st.integers(1, 5), st.integers(1, 70), st.integers(0, 2**31 - 1))
    def check(rows, vocab, seed):
        rng = np.random.default_rng(seed)
        x = rng.integers(-3, 3, size=(rows, vocab)).astype(np.float32)  # few values: ties everywhere
        x[rng.random(x.shape) < 0.3] = -np.inf
        x[0] = -np.inf if seed % 3 == 0 else x[0]
        ours = np.asarray(VocabShard(vocab, vocab).argmax(jnp.asarray(x)))
        np.testing.assert_array_equal(ours, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    check()
    nan = np.zeros((2, 9), np.float32)
    nan[1, 4] = np.nan
    assert 0 <= int(VocabShard(9, 9).argmax(jnp.asarray(nan))[1]) < 9
