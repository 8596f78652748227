"""The requests' PRNG keys, computed in numpy, equal jax.random's bit for bit (so seeded outputs are
the same as when the keys came from jax.random, and independent of how requests are batched)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from modelopt_jax import SamplingParams
from modelopt_jax.request_keys import fold_in, sample_keys, seed_keys

SEEDS = [0, 1, 7, 12345, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 5, 2**63 - 1,
         123456789012345, *np.random.default_rng(0).integers(0, 2**62, 20).tolist()]


def _raw(key) -> np.ndarray:
    return np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key, np.uint32)


def _jax_key(seed: int):
    return jax.random.fold_in(jax.random.PRNGKey(seed & 0xFFFFFFFF), (seed >> 32) & 0xFFFFFFFF)


def test_seed_keys_equal_jax_random():
    got = seed_keys(SEEDS)
    assert got.dtype == np.uint32 and got.shape == (len(SEEDS), 2)
    for seed, key in zip(SEEDS, got):
        np.testing.assert_array_equal(key, _raw(_jax_key(seed)), err_msg=f"seed {seed}")
    assert len({tuple(k) for k in got.tolist()}) == len(SEEDS)  # seeds differing above bit 31 stay distinct


@pytest.mark.parametrize("data", [1, 2, 7, 255, 2**31, 2**32 - 1])
def test_fold_in_equals_jax_random(data):
    keys = seed_keys(SEEDS[:8])
    got = fold_in(keys, np.full(len(keys), data, np.uint64))
    for seed, key in zip(SEEDS[:8], got):
        np.testing.assert_array_equal(key, _raw(jax.random.fold_in(_jax_key(seed), data)))


def test_sample_zero_keeps_the_request_key_and_the_others_fold_their_index():
    keys = seed_keys([5, 5, 5, 9])
    got = sample_keys(keys, np.array([0, 1, 2, 0]))
    np.testing.assert_array_equal(got[0], keys[0])
    np.testing.assert_array_equal(got[3], keys[3])
    np.testing.assert_array_equal(got[1], _raw(jax.random.fold_in(_jax_key(5), 1)))
    np.testing.assert_array_equal(got[2], _raw(jax.random.fold_in(_jax_key(5), 2)))


def test_requests_carry_those_keys():
    """LLM.requests gives each sample of each prompt its key: the same for a prompt alone or in a batch."""
    from fixture_paths import fixture_dir
    from modelopt_jax import LLM

    llm = LLM(str(fixture_dir("qwen2-bytes-fp8")), max_model_len=64, kv_cache_bytes=8 << 20)
    params = [SamplingParams(seed=2**33 + 3, n=3, max_tokens=2), SamplingParams(seed=11, max_tokens=2)]
    batch = llm.requests([[5, 6, 7], [8, 9]], params)
    assert [r.sample_index for r in batch] == [0, 1, 2, 0]
    want = [_raw(_jax_key(2**33 + 3)), _raw(jax.random.fold_in(_jax_key(2**33 + 3), 1)),
            _raw(jax.random.fold_in(_jax_key(2**33 + 3), 2)), _raw(_jax_key(11))]
    for r, key in zip(batch, want):
        np.testing.assert_array_equal(r.row_key, key)
    alone = llm.requests([[8, 9]], params[1])
    np.testing.assert_array_equal(alone[0].row_key, batch[3].row_key)


def test_token_id_prompts_of_every_integer_kind_are_taken_and_others_refused():
    from fixture_paths import fixture_dir
    from modelopt_jax import LLM
    from modelopt_jax.errors import RequestTypeError

    llm = LLM(str(fixture_dir("qwen2-bytes-fp8")), max_model_len=64, kv_cache_bytes=8 << 20)
    for prompt in ([5, 6, 7], (5, 6, 7), np.array([5, 6, 7], np.int32), np.array([5, 6, 7], np.uint16),
                   [np.int64(5), 6, np.int8(7)]):
        (r,) = llm.requests([prompt])
        assert r.prompt_ids == [5, 6, 7] and all(type(t) is int for t in r.prompt_ids)
    for bad in ([5, True, 7], [5, 6.0], np.array([5.0, 6.0]), np.array([True, False]), [5, "6"],
                np.array([[5, 6]]), [5, np.bool_(True)]):
        with pytest.raises(RequestTypeError, match="prompt 0 must be"):
            llm.requests([bad])
