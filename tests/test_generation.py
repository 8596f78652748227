"""KV-cached generation: ``LLM.generate``, ``make_cached_forward``/``init_cache`` and the sampler.

What is checked, and against what:
  * greedy continuations (float32) vs the fixtures' reference.json (ModelOpt / transformers);
  * the cached forward vs the cache-less ``model(ids)`` (prefill + one-token decode steps);
  * batching, sampling (seeds, top-k, top-p, frequencies vs softmax), log-probs, stopping rules;
  * clear errors for bad inputs, and the KV-cache dtype rules.

LLM instances are shared per module (each new (batch, prompt-length) bucket compiles a program), and
every LLM passes ``compilation_cache_dir=None`` so the tests write nothing to ~/.cache.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import modelopt_jax
from fixture_paths import fixture_dir
from modelopt_jax import LLM, SamplingParams, init_cache, make_cached_forward
from modelopt_jax.errors import (CheckpointError, ConfigError, InvalidArgumentError, ModelOptJaxError, RequestError,
                                 RequestTypeError)
from modelopt_jax.ops.quantize import fake_quantize_static, quantize_static
from modelopt_jax.sampling import sample

GREEDY_48 = SamplingParams(max_tokens=48, ignore_eos=True)


def references(name: str) -> list[dict]:
    return json.loads((fixture_dir(name) / "reference.json").read_text())["results"]


def make_llm(name_or_path, **kwargs) -> LLM:
    path = fixture_dir(name_or_path) if isinstance(name_or_path, str) else name_or_path
    kwargs = {"quantization": None, "dtype": "float32", "max_model_len": 128, "compilation_cache_dir": None,
              **kwargs}
    return LLM(path, **kwargs)


@pytest.fixture(scope="module")
def llms():
    """Lazily built float32 LLMs by fixture name, shared by every test in this module."""
    cache: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in cache:
            cache[name] = make_llm(name)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def bf16(llms) -> LLM:
    return llms("qwen2-bytes-bf16")


@pytest.fixture(scope="module")
def greedy_runs(llms):
    """name -> the batched greedy run of the four reference prompts (48 tokens each)."""
    cache: dict[str, list] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = llms(name).generate([r["input_ids"] for r in references(name)], GREEDY_48)
        return cache[name]

    return get


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


_JITTED: dict[int, tuple] = {}


def jitted(model):
    """(cache-less forward, cached forward, its state), jitted once per model."""
    if id(model) not in _JITTED:
        forward, state = make_cached_forward(model, jit=True)
        _JITTED[id(model)] = (jax.jit(lambda ids: model(ids)), forward, state, model)
    return _JITTED[id(model)][:3]


def padded_cacheless(model, seqs, width: int = 128) -> list[np.ndarray]:
    """Cache-less logits [T, vocab] per sequence, right-padded to one width so one program serves all
    lengths (causal attention: the padding is invisible to the real positions, up to float32
    summation order -- which, for FP8-activation models, can flip near-tie codes; used here for
    the unquantized model only)."""
    ids = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    logits = np.asarray(jitted(model)[0](jnp.asarray(ids)))
    return [logits[i, :len(s)] for i, s in enumerate(seqs)]


def cacheless_logits(llm: LLM, ids) -> np.ndarray:
    """float32 [T, vocab] logits of the cache-less forward for one sequence."""
    return padded_cacheless(llm.model, [ids])[0]


def log_softmax(x: np.ndarray) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


# ------------------------------------------------------------------------------------------------
# Greedy continuations vs reference.json
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2-bytes-bf16", "qwen2-bytes-fp8"])
def test_greedy_equals_reference_exactly(greedy_runs, name):
    refs = references(name)
    outs = greedy_runs(name)
    for r, out in zip(refs, outs):
        assert out.prompt_token_ids == r["input_ids"]
        assert out.token_ids == r["new_token_ids"], f"{name} {r['prompt']!r}"
        assert out.finish_reason == "length"


def test_greedy_fp8_kv_diverges_only_at_near_ties(greedy_runs):
    # Measured: 191/192 tokens equal. The single difference is the LAST token (position 47) of
    # prompt 0 ('The '), where the reference's top1-top2 margin is 0.0696: ModelOpt's fake-quant
    # and our FP8 path round one activation near an FP8 code boundary differently (see the
    # fixture README's precision caveat), which moves logits by ~0.1 and swaps a near-tie.
    # The assertions: (1) every differing position has reference margin < 0.1, and (2) the first
    # divergence of each prompt (if any) is at such a margin. (1) is the stricter one; it holds
    # because the only divergence is at the last position, so no later token is conditioned on a
    # different history. A divergence where the reference was decisive (>= 0.1) would be a bug.
    name = "qwen2-bytes-fp8-kv"
    near_tie = 0.1
    equal = 0
    for r, out in zip(references(name), greedy_runs(name)):
        got, ref = np.asarray(out.token_ids), np.asarray(r["new_token_ids"])
        margins = np.asarray(r["top1_minus_top2_logit"])
        assert got.shape == ref.shape
        equal += int((got == ref).sum())
        differ = np.flatnonzero(got != ref)
        assert (margins[differ] < near_tie).all(), (r["prompt"], differ, margins[differ])
        first = first_divergence(got, ref)
        assert first is None or margins[first] < near_tie, (r["prompt"], first, margins[first])
    print(f"{name}: greedy tokens equal to reference.json {equal}/192")
    assert equal >= 191


def test_fp8_pc_pt_teacher_forced_through_cache(llms, greedy_runs):
    # Per-token dynamic activation scales make this variant the most tie-sensitive (the fixture's
    # own pure-torch rebuild gets only 135/192 free-running). So the hard check is teacher-forced:
    # prefill prompt + reference tokens through the CACHED forward and require argmax == reference
    # wherever the reference top1-top2 margin exceeds 0.5 (151 of the 192 positions; measured:
    # the argmax agrees at all 192). A flip at a margin > 0.5 cannot come from one FP8 code moving
    # (that shifts logits by ~0.1-0.4) and would be a real numerical error.
    name = "qwen2-bytes-fp8-pc-pt"
    llm = llms(name)
    _, forward, state = jitted(llm.model)
    decisive_total = agree_total = 0
    for r in references(name):
        prompt, ref = r["input_ids"], np.asarray(r["new_token_ids"])
        # right-padded to 72 tokens (one compiled shape); padding sits at later positions, which the
        # real tokens never attend to (summation order may differ: covered by the 0.5 margin)
        seq = np.zeros((1, 72), np.int32)
        seq[0, :len(prompt) + len(ref)] = prompt + r["new_token_ids"]
        cache = init_cache(llm.model, 1, 128)
        logits, _ = forward(state, jnp.asarray(seq), jnp.arange(72, dtype=jnp.int32)[None], cache)
        pred = np.asarray(logits)[0, len(prompt) - 1:len(prompt) + len(ref) - 1].argmax(-1)
        margins = np.asarray(r["top1_minus_top2_logit"])
        decisive = margins > 0.5
        assert (pred[decisive] == ref[decisive]).all(), (r["prompt"], np.flatnonzero(decisive & (pred != ref)))
        decisive_total += int(decisive.sum())
        agree_total += int((pred == ref).sum())
    assert decisive_total >= 140  # the check covers most positions
    print(f"{name}: teacher-forced (cached) argmax = reference at {agree_total}/192, "
          f"all {decisive_total} with margin > 0.5 required")
    # Free-running greedy is reported, not asserted (one near-tie flip changes the rest).
    equal = 0
    for r, out in zip(references(name), greedy_runs(name)):
        equal += sum(a == b for a, b in zip(out.token_ids, r["new_token_ids"]))
        first = first_divergence(out.token_ids, r["new_token_ids"])
        margin = None if first is None else r["top1_minus_top2_logit"][first]
        print(f"  {r['prompt']!r}: first divergence {first}, reference margin there {margin}")
    print(f"{name}: free-running greedy equal to reference {equal}/192")


# ------------------------------------------------------------------------------------------------
# Cached forward vs cache-less forward
# ------------------------------------------------------------------------------------------------

def cached_then_decoded(model, seq, prefill: int, max_len: int = 128):
    """Logits [T, vocab] from prefilling ``prefill`` tokens then decoding one token at a time."""
    _, forward, state = jitted(model)
    cache = init_cache(model, 1, max_len)
    ids = jnp.asarray([seq], jnp.int32)
    logits, cache = forward(state, ids[:, :prefill], jnp.arange(prefill, dtype=jnp.int32)[None], cache)
    out = [np.asarray(logits)[0]]
    for p in range(prefill, len(seq)):
        logits, cache = forward(state, ids[:, p:p + 1], jnp.asarray([[p]], jnp.int32), cache)
        out.append(np.asarray(logits)[0])
    return np.concatenate(out), cache


def test_cached_decode_matches_cacheless_unquantized(bf16):
    r = references("qwen2-bytes-bf16")[1]
    seq = r["input_ids"] + r["new_token_ids"]  # 65 tokens
    cached, cache = cached_then_decoded(bf16.model, seq, prefill=7)
    assert cache.keys[0].dtype == jnp.float32 and not cache.is_fp8
    (ref,) = padded_cacheless(bf16.model, [seq])
    diff = np.abs(cached - ref).max()
    # Only float32 summation order differs (measured max 1.2e-5).
    assert diff <= 1e-4, diff


def test_cached_decode_matches_cacheless_fp8_kv(llms):
    # With an FP8 KV cache the cache stores FP8 codes and the cache-less forward rounds k/v to the
    # same grid, so the two agree up to float32 summation order -- except that with FP8
    # activations a different summation order (e.g. the cache's extra, masked, keys) can flip an
    # FP8 activation code at a rounding near-tie. That moves the position's logits by ~0.1-0.4 and,
    # through the later layers' attention, every later position of that sequence by > 1e-4.
    # Measured (prefill 5 tokens, then 1-token decode steps, vs model(ids) on each unpadded
    # sequence): 245/245 positions within 1e-4 (max 2.2e-5). For scale, the cache-less forward
    # against ITSELF with the same 4 sequences right-padded to 128 instead of 72 agrees at only
    # 194/245 positions (79%, max 0.43): one flip early in one sequence. Bound: >= 75% of positions
    # within 1e-4 (tolerates one such flip), and every position within 1.0. A wrong cache (codes,
    # scales, positions or masking) breaks every decoded position, i.e. > 90% of them.
    llm = llms("qwen2-bytes-fp8-kv")
    cacheless = jitted(llm.model)[0]
    close = total = 0
    worst = 0.0
    for r in references("qwen2-bytes-fp8-kv"):
        seq = r["input_ids"] + r["new_token_ids"]
        ref = np.asarray(cacheless(jnp.asarray([seq], jnp.int32)))[0]  # exactly as a user calls it
        cached, cache = cached_then_decoded(llm.model, seq, prefill=5)
        assert cache.is_fp8 and all(k.dtype == jnp.float8_e4m3fn for k in cache.keys + cache.values)
        per_pos = np.abs(cached - ref).max(-1)
        close += int((per_pos <= 1e-4).sum())
        total += len(seq)
        worst = max(worst, float(per_pos.max()))
    print(f"fp8-kv cached vs cache-less: {close}/{total} positions within 1e-4, max diff {worst:.3g}")
    assert close >= 0.75 * total
    assert worst <= 1.0


def test_fp8_cache_stores_quantized_rope_keys(llms):
    """Layer 0's cache holds exactly quantize_static(k_after_rope, k_scale) (and likewise v)."""
    llm = llms("qwen2-bytes-fp8-kv")
    model = llm.model
    attn = model.layers[0].self_attn
    k_scale, v_scale = attn.kv.k_scale, attn.kv.v_scale
    seq = references("qwen2-bytes-fp8-kv")[2]["input_ids"]
    t = len(seq)
    ids = jnp.asarray([seq], jnp.int32)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    _, forward, state = jitted(model)
    _, cache = forward(state, ids, positions, init_cache(model, 1, 64))

    @jax.jit
    def expected(ids, positions):
        x = model.layers[0].input_layernorm(model.embed_tokens(ids))
        _, k, v = attn.project_qkv(x, positions)
        k_fq, v_fq = attn.kv.round_trip(k, v)  # what the cache-less forward attends over
        return quantize_static(k, k_scale), quantize_static(v, v_scale), k_fq, v_fq

    k_q, v_q, k_fq, v_fq = expected(ids, positions)
    cache_k, cache_v = np.asarray(cache.keys[0].data), np.asarray(cache.values[0].data)
    assert cache_k.dtype == np.dtype(jnp.float8_e4m3fn)
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731  (exact codes, not values)
    np.testing.assert_array_equal(bits(cache_k[0, :t]), bits(k_q[0]))
    np.testing.assert_array_equal(bits(cache_v[0, :t]), bits(v_q[0]))
    assert not bits(cache_k[0, t:]).any() and not bits(cache_v[0, t:]).any()  # untouched slots
    # code * scale (what the cached attention reads) is the cache-less fake-quant value
    np.testing.assert_array_equal(cache_k[0, :t].astype(np.float32) * np.float32(k_scale), np.asarray(k_fq[0]))
    np.testing.assert_array_equal(cache_v[0, :t].astype(np.float32) * np.float32(v_scale), np.asarray(v_fq[0]))
    np.testing.assert_array_equal(np.asarray(fake_quantize_static(k_fq, k_scale)), np.asarray(k_fq))


# ------------------------------------------------------------------------------------------------
# Batching
# ------------------------------------------------------------------------------------------------

def test_batch_equals_alone_float32(bf16, greedy_runs):
    refs = references("qwen2-bytes-bf16")
    batched = greedy_runs("qwen2-bytes-bf16")  # the 4 prompts (5, 17, 14, 17 tokens) in one batch
    assert len({len(r["input_ids"]) for r in refs}) > 1
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for r, together in zip(refs, batched):
        (alone,) = bf16.generate([r["input_ids"]], params)
        assert alone.token_ids == together.token_ids[:24], r["prompt"]


@pytest.fixture(scope="module")
def demo_bf16() -> LLM:
    return LLM(modelopt_jax.demo_checkpoint_path(), dtype="bfloat16", max_model_len=128, compilation_cache_dir=None)


def test_batch_equals_alone_fp8_demo_bfloat16(demo_bf16):
    # Holds in bfloat16 too (measured on these prompts): each row's math does not depend on the
    # other rows or on the padded shapes, so even FP8 near-ties round the same way.
    prompts = ["It is a truth", "The ", "Once upon a"]  # 14, 5, 12 tokens: one length bucket
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    together = demo_bf16.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        (alone,) = demo_bf16.generate(prompt, params)
        assert alone.token_ids == out.token_ids, prompt
        assert out.prompt == prompt and out.text == demo_bf16.tokenizer.decode(out.token_ids)


# ------------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sampling_prompt():
    return references("qwen2-bytes-bf16")[2]["input_ids"]  # 'It is a truth', 14 tokens


@pytest.fixture(scope="module")
def greedy16(bf16, sampling_prompt):
    return bf16.generate(sampling_prompt, SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids


def run(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True, **kw))[0].token_ids


def test_seeded_sampling_reproduces_and_seeds_differ(bf16, sampling_prompt):
    a = run(bf16, sampling_prompt, temperature=1.0, seed=1)
    b = run(bf16, sampling_prompt, temperature=1.0, seed=1)
    c = run(bf16, sampling_prompt, temperature=1.0, seed=2)
    assert a == b
    assert a != c
    # A request's seed fixes its tokens whatever else is in the batch.
    other = references("qwen2-bytes-bf16")[1]["input_ids"]
    together = bf16.generate([other, sampling_prompt], [SamplingParams(max_tokens=16, temperature=1.0, seed=9),
                                                        SamplingParams(max_tokens=16, temperature=1.0, seed=1,
                                                                       ignore_eos=True)])
    assert together[1].token_ids == a


def test_top_k_1_and_tiny_top_p_are_greedy(bf16, sampling_prompt, greedy16):
    assert run(bf16, sampling_prompt, temperature=1.0, top_k=1, seed=3) == greedy16
    assert run(bf16, sampling_prompt, temperature=1.0, top_p=1e-6, seed=3) == greedy16
    assert run(bf16, sampling_prompt, temperature=1.0, top_p=1e-300, seed=3) == greedy16  # 0 in float32: top-1 stays
    assert run(bf16, sampling_prompt, temperature=1.0, seed=3) != greedy16  # temperature alone is not


def test_sampler_frequencies_match_softmax():
    """``sample`` on synthetic logits: empirical frequencies vs the (truncated, tempered) softmax.

    N = 20000 draws per setting. Each frequency is Binomial(N, p)/N with std sqrt(p(1-p)/N)
    (<= 0.0036); we require |freq - p| <= 5 std for every token (a correct sampler fails this with
    probability < 8 * 6e-7 per setting), and exactly zero frequency for tokens top-k/top-p remove.
    The keys are fixed, so the test is deterministic anyway.
    """
    p0 = np.array([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005])
    logits = np.log(p0).astype(np.float32) + 3.0  # shift: only differences matter
    n = 20000
    perm = np.random.default_rng(0).permutation(8)  # not sorted, so indices are not ranks
    logits, p0 = logits[perm], p0[perm]
    order = np.argsort(-p0)

    def expected(temperature, top_k, top_p):
        p = np.exp(np.log(p0) / temperature)
        p /= p.sum()
        p = np.where(np.isin(np.arange(8), order[:top_k if top_k > 0 else 8]), p, 0.0)  # top-k first,
        p /= p.sum()  # then top-p on the renormalized top-k distribution (vLLM, HF transformers)
        cum_before = np.cumsum(p[order]) - p[order]
        p[order[cum_before >= top_p]] = 0.0  # keep the smallest prefix whose mass reaches top_p
        return p / p.sum()

    keys = jax.random.split(jax.random.PRNGKey(0), n)
    batch = jnp.broadcast_to(jnp.asarray(logits), (n, 8))
    # (1.0, 3, 0.45): top-3 renormalized is (.5, .31, .19), so top-p keeps only the top token (top-p
    # on the full distribution would wrongly keep two: .40 < .45).
    settings = [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.0, 3, 1.0), (1.0, -1, 0.7), (2.0, 5, 0.9), (1.0, 3, 0.45),
                (1.0, 4, 0.85)]
    for temperature, top_k, top_p in settings:
        tokens = np.asarray(sample(batch, jnp.full((n,), temperature, jnp.float32), jnp.full((n,), top_k, jnp.int32),
                                   jnp.full((n,), top_p, jnp.float32), keys))
        freq = np.bincount(tokens, minlength=8) / n
        p = expected(temperature, top_k, top_p)
        bound = 5 * np.sqrt(p * (1 - p) / n)
        assert (np.abs(freq - p) <= bound).all(), (temperature, top_k, top_p, freq, p)
        assert (freq[p == 0] == 0).all()
    # temperature 0 is an exact argmax whatever the other settings
    greedy = sample(batch[:4], jnp.zeros(4), jnp.asarray([-1, 1, 3, 8], jnp.int32), jnp.asarray([1.0, 0.1, 0.5, 1.0]),
                    keys[:4])
    assert (np.asarray(greedy) == np.argmax(logits)).all()


def test_cheaper_samplers_give_the_truncated_samplers_tokens():
    """A step whose rows need no top-k/top-p runs the "tempered" sampler (no sort), one whose rows are
    all greedy runs an argmax: each gives every row the very token the "truncated" sampler gives it
    with the same key, over a Llama-3-sized vocabulary where the sort is what costs."""
    from modelopt_jax.sampling import sampler_for

    rng = np.random.default_rng(3)
    n, vocab = 16, 128256
    logits = jnp.asarray((rng.standard_normal((n, vocab)) * 4).astype(np.float32))
    keys = jax.random.split(jax.random.PRNGKey(7), n)
    temps = jnp.asarray(np.r_[np.zeros(4), rng.uniform(0.3, 2.0, n - 4)].astype(np.float32))
    no_k, no_p = jnp.full((n,), -1, jnp.int32), jnp.ones(n, jnp.float32)
    truncated = np.asarray(sample(logits, temps, no_k, no_p, keys, "truncated"))
    tempered = np.asarray(sample(logits, temps, no_k, no_p, keys, "tempered"))
    np.testing.assert_array_equal(tempered, truncated)
    assert len(set(truncated[4:].tolist())) > 1  # the draws are draws, not a constant
    argmax = np.asarray(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(truncated[:4], argmax[:4])
    np.testing.assert_array_equal(np.asarray(sample(logits, jnp.zeros(n), no_k, no_p, keys, "greedy")), argmax)
    # the programs: only the truncated sampler sorts
    for sampler in ("greedy", "tempered", "truncated"):
        hlo = jax.jit(lambda *a, s=sampler: sample(*a, s)).lower(logits, temps, no_k, no_p, keys).as_text()
        assert ("sort" in hlo) == (sampler == "truncated"), sampler
    # which sampler a batch gets: the cheapest exact one
    assert sampler_for([SamplingParams(), SamplingParams(top_k=5, top_p=0.5)]) == "greedy"
    assert sampler_for([SamplingParams(), SamplingParams(temperature=0.7)]) == "tempered"
    assert sampler_for([SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9)]) == "truncated"
    assert sampler_for([SamplingParams(temperature=1.0, top_k=40)]) == "truncated"
    with pytest.raises(ValueError, match="sampler"):
        sample(logits, temps, no_k, no_p, keys, "fast")


# ------------------------------------------------------------------------------------------------
# Log-probs
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def logprob_run(bf16):
    prompts = [references("qwen2-bytes-bf16")[3]["input_ids"], references("qwen2-bytes-bf16")[0]["input_ids"]]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1, temperature=1.0, seed=5)]
    return bf16.generate(prompts, params)


def test_generated_logprobs_equal_cacheless_log_softmax(bf16, logprob_run):
    for out, k in zip(logprob_run, (3, 1)):
        seq = out.prompt_token_ids + out.token_ids
        logp = log_softmax(cacheless_logits(bf16, seq))
        start = len(out.prompt_token_ids) - 1
        assert len(out.logprobs) == len(out.token_ids) == 10
        for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = logp[start + i]
            top = np.argsort(-row)[:k]
            assert tok in entry and set(top) <= set(entry) and len(entry) <= k + 1
            assert set(entry) == set(top) | {tok}
            for t, value in entry.items():
                assert abs(value - row[t]) <= 1e-4, (i, t, value, row[t])
        assert math.isclose(out.cumulative_logprob, sum(e[t] for e, t in zip(out.logprobs, out.token_ids)),
                            rel_tol=0, abs_tol=1e-6)
    greedy_row, sampled_row = logprob_run
    assert all(max(e, key=e.get) == t for e, t in zip(greedy_row.logprobs, greedy_row.token_ids))
    # the sampled row's chosen tokens are not always the top-1, so its dicts can hold 2 entries
    assert any(len(e) == 2 for e in sampled_row.logprobs)


def test_prompt_logprobs_equal_cacheless_log_softmax(bf16, logprob_run):
    out, other = logprob_run
    assert other.prompt_logprobs is None
    prompt = out.prompt_token_ids
    logp = log_softmax(cacheless_logits(bf16, prompt))
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[pos], logp[pos - 1]
        assert prompt[pos] in entry
        assert set(entry) == set(np.argsort(-row)[:2]) | {prompt[pos]}
        for t, value in entry.items():
            assert abs(value - row[t]) <= 1e-4, (pos, t, value, row[t])


def test_no_logprobs_requested_gives_none_but_cumulative(bf16, sampling_prompt):
    (out,) = bf16.generate(sampling_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.logprobs is None and out.prompt_logprobs is None
    logp = log_softmax(cacheless_logits(bf16, out.prompt_token_ids + out.token_ids))
    start = len(out.prompt_token_ids) - 1
    expected = sum(logp[start + i, t] for i, t in enumerate(out.token_ids))
    assert abs(out.cumulative_logprob - expected) <= 1e-4


# ------------------------------------------------------------------------------------------------
# Stopping
# ------------------------------------------------------------------------------------------------

def test_stop_token_stops_with_reason_stop(bf16, sampling_prompt, greedy16):
    stop = greedy16[2]
    end = greedy16.index(stop)  # the first time greedy produces it (at most index 2)
    (out,) = bf16.generate(sampling_prompt, SamplingParams(max_tokens=16, stop_token_ids=[stop]))
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy16[:end + 1]  # the stop token is included, nothing after


def test_eos_stops_unless_ignored(bf16, sampling_prompt, greedy16, monkeypatch):
    assert bf16.eos_token_ids == [257]  # from generation_config.json
    monkeypatch.setattr(bf16, "eos_token_ids", [greedy16[2]])  # pretend greedy's 3rd token is EOS
    end = greedy16.index(greedy16[2])
    (out,) = bf16.generate(sampling_prompt, SamplingParams(max_tokens=16))
    assert out.finish_reason == "stop" and out.token_ids == greedy16[:end + 1]
    (out,) = bf16.generate(sampling_prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    assert out.finish_reason == "length" and out.token_ids == greedy16


def test_max_tokens_gives_length(bf16, sampling_prompt, greedy16):
    for n in (1, 5):
        (out,) = bf16.generate(sampling_prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        assert out.finish_reason == "length" and out.token_ids == greedy16[:n]


def test_max_model_len_caps_generation(bf16):
    assert bf16.max_model_len == 128
    prompt = [256] + list(b"It is a truth universally acknowledged, that a single man in possession of a good "
                          b"fortune, must be in want of a wife. However little known")[:119]
    assert len(prompt) == 120
    (out,) = bf16.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 8  # 120 + 8 = max_model_len
    (out,) = bf16.generate(prompt + [32] * 7, SamplingParams(max_tokens=48, ignore_eos=True))
    assert len(out.token_ids) == 1


# ------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------

def test_empty_prompts_raise(bf16):
    with pytest.raises(ValueError, match="empty"):
        bf16.generate("")
    with pytest.raises(ValueError, match="empty"):
        bf16.generate([[]])
    with pytest.raises(ValueError, match="no prompts"):
        bf16.generate([])


def test_prompt_longer_than_max_model_len_raises(bf16):
    with pytest.raises(ValueError, match="max_model_len"):
        bf16.generate([256] + [65] * 200)
    with pytest.raises(ValueError, match="max_model_len"):
        bf16.generate([256] + [65] * 127)  # exactly max_model_len: no room to generate


def test_token_ids_outside_vocab_raise(bf16):
    with pytest.raises(ValueError, match="outside"):
        bf16.generate([256, 264])
    with pytest.raises(ValueError, match="outside"):
        bf16.generate([256, -1])


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": -3}, {"top_p": 0.0}, {"top_p": 1.5},
                                    {"temperature": -1.0}])
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_unknown_kwargs_raise_type_error(bf16):
    with pytest.raises(TypeError, match="gpu_memory_utilization"):
        LLM(fixture_dir("qwen2-bytes-bf16"), gpu_memory_utilization=0.9, compilation_cache_dir=None)
    with pytest.raises(TypeError, match="lora_request"):
        bf16.generate([1, 2, 3], lora_request=object())


def test_quantization_argument(bf16):
    with pytest.raises(ConfigError, match="not a ModelOpt checkpoint"):
        LLM(fixture_dir("qwen2-bytes-bf16"), quantization="modelopt", compilation_cache_dir=None)
    assert bf16.model is not None  # quantization=None loaded it (the shared fixture)
    with pytest.raises(ValueError, match="gptq"):
        LLM(fixture_dir("qwen2-bytes-fp8"), quantization="gptq", compilation_cache_dir=None)


def test_bad_kv_cache_dtype_raises():
    with pytest.raises(ValueError, match="int4"):
        make_llm("qwen2-bytes-fp8", kv_cache_dtype="int4")


def test_string_prompt_without_tokenizer_raises(tmp_path):
    src = fixture_dir("llama-tiny-fp8")
    dst = tmp_path / "llama-tiny-fp8"
    shutil.copytree(src, dst)
    assert not (dst / "tokenizer.json").exists()
    llm = make_llm(dst)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer.json"):
        llm.generate("hello")
    with pytest.raises(RequestTypeError, match="prompt 0 must be a string, a list of token ids"):
        llm.generate([1.5])


@pytest.mark.parametrize("kwargs,error", [
    ({"seed": "abc"}, RequestTypeError), ({"seed": 1.0}, RequestTypeError), ({"seed": 1 << 64}, RequestError),
    ({"top_k": 1.5}, RequestTypeError), ({"max_tokens": True}, RequestTypeError), ({"max_tokens": "3"}, RequestTypeError),
    ({"ignore_eos": 1}, RequestTypeError), ({"stop_token_ids": "ab"}, RequestTypeError),
    ({"stop_token_ids": [3, -1]}, RequestError), ({"temperature": float("nan")}, RequestError),
    ({"temperature": "hot"}, RequestTypeError), ({"top_p": float("inf")}, RequestError),
    ({"logprobs": -1}, RequestError), ({"logprobs": 5000}, RequestError), ({"prompt_logprobs": 2.0}, RequestTypeError)])
def test_sampling_params_are_checked_when_built(kwargs, error):
    """Each bad field fails at construction with a typed error naming it (ValueError/TypeError compatible)."""
    with pytest.raises(error, match=next(iter(kwargs)).split("_ids")[0]) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ModelOptJaxError)
    assert SamplingParams(seed=(1 << 64) - 1, stop_token_ids=np.array([1, 2])).stop_token_ids == (1, 2)


def test_generate_arguments_are_checked(bf16):
    with pytest.raises(RequestTypeError, match="a prompt or a list of prompts, got NoneType"):
        bf16.generate(None)
    with pytest.raises(RequestTypeError, match="sampling_params must be a SamplingParams, got dict"):
        bf16.generate([1, 2, 3], {"max_tokens": 3})
    with pytest.raises(RequestTypeError, match=r"sampling_params\[1\] must be a SamplingParams"):
        bf16.generate([[1, 2], [3, 4]], [SamplingParams(), None])
    with pytest.raises(RequestError, match="logprobs=1000 exceeds the vocabulary"):
        bf16.generate([1, 2, 3], SamplingParams(logprobs=1000))
    with pytest.raises(RequestError, match="stop_token_ids"):
        bf16.generate([1, 2, 3], SamplingParams(stop_token_ids=[10_000]))
    with pytest.raises(RequestError, match=r"exactly one of 'prompt'.*got keys \['text'\]"):
        bf16.generate({"text": "hi"})
    with pytest.raises(RequestTypeError, match="prompt 1: 'prompt' must be a string"):
        bf16.generate([{"prompt_token_ids": [1, 2]}, {"prompt": [1, 2]}])


@pytest.mark.parametrize("kwargs,match", [
    ({"max_model_len": 0}, "max_model_len=0 must be an integer in \\[2, 512\\]"),
    ({"max_model_len": 4096}, "max_model_len=4096 must be"), ({"max_model_len": 100.0}, "max_model_len=100.0"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be a positive integer"),
    ({"tokenizer": "/nonexistent/tok"}, "tokenizer='/nonexistent/tok': no tokenizer.json there"),
    ({"quantization": "gptq"}, "quantization='gptq' not supported")])
def test_llm_arguments_are_checked_before_the_weights_load(kwargs, match, monkeypatch):
    """Each fails with a typed error naming the argument, and before any weight is read."""
    import modelopt_jax.llm as llm_module

    monkeypatch.setattr(llm_module, "load", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(InvalidArgumentError, match=match):
        LLM(None, compilation_cache_dir=None, **kwargs)


def test_a_corrupt_tokenizer_is_a_checkpoint_error_naming_the_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(CheckpointError, match=f"{bad}: not a readable tokenizer.json"):
        LLM(None, tokenizer=str(tmp_path), max_model_len=64, compilation_cache_dir=None)


def test_dict_prompts_are_vllm_text_and_token_prompts(demo_bf16):
    """``{"prompt": text}`` is that text (it used to iterate the dict's keys and continue the word
    "prompt"); ``{"prompt_token_ids": ids}`` is those ids."""
    params = SamplingParams(max_tokens=6)
    (text,) = demo_bf16.generate("Elizabeth", params, use_tqdm=False)
    (as_dict,) = demo_bf16.generate({"prompt": "Elizabeth"}, params, use_tqdm=False)
    assert as_dict.token_ids == text.token_ids and as_dict.prompt == "Elizabeth"
    both = demo_bf16.generate([{"prompt_token_ids": text.prompt_token_ids}, "Elizabeth"], params, use_tqdm=False)
    assert [o.token_ids for o in both] == [text.token_ids] * 2


# ------------------------------------------------------------------------------------------------
# KV-cache dtype
# ------------------------------------------------------------------------------------------------

def test_kv_cache_dtype_auto(llms, bf16):
    fp8_kv = llms("qwen2-bytes-fp8-kv").model
    spec = fp8_kv.kv_cache  # resolved once, at load, from the checkpoint's k/v scales
    assert spec.is_fp8 and spec.requested == "auto"
    assert spec.scales == tuple((layer.self_attn.kv.k_scale, layer.self_attn.kv.v_scale) for layer in fp8_kv.layers)
    assert all(s != (1.0, 1.0) for s in spec.scales)
    assert init_cache(fp8_kv, 2, 16).keys[0].dtype == jnp.float8_e4m3fn
    tiny_kv = modelopt_jax.load(fixture_dir("llama-tiny-fp8-kv"), dtype="bfloat16")
    assert init_cache(tiny_kv, 1, 8).is_fp8
    # no k/v scales: the compute dtype
    assert init_cache(bf16.model, 1, 8).keys[0].dtype == jnp.float32
    fp8_bf16 = modelopt_jax.load(fixture_dir("qwen2-bytes-fp8"), dtype="bfloat16")
    cache = fp8_bf16.init_cache(1, 8)
    assert cache.keys[0].dtype == jnp.bfloat16 and not cache.is_fp8
    assert cache.keys[0].shape == (1, 8, fp8_bf16.config.num_key_value_heads, fp8_bf16.config.head_dim)
    # explicit float dtypes override auto, also on an FP8-KV checkpoint
    plain = modelopt_jax.load(fixture_dir("qwen2-bytes-fp8-kv"), dtype="float32", kv_cache_dtype="bfloat16")
    assert init_cache(plain, 1, 8).keys[0].dtype == jnp.bfloat16 and not plain.kv_cache.is_fp8
    with pytest.raises(ConfigError, match="kv_cache_dtype='int4'"):
        modelopt_jax.load(fixture_dir("qwen2-bytes-fp8"), kv_cache_dtype="int4")


def test_forcing_fp8_without_scales_warns_and_uses_scale_one(llms):
    with pytest.warns(UserWarning, match="scale 1.0") as record:
        forced = modelopt_jax.load(fixture_dir("qwen2-bytes-bf16"), dtype="float32", kv_cache_dtype="fp8")
    assert len([w for w in record if "scale 1.0" in str(w.message)]) == 1  # once per load
    cache = init_cache(forced, 1, 8)
    assert cache.is_fp8 and cache.keys[0].dtype == jnp.float8_e4m3fn
    assert cache.scales == tuple((1.0, 1.0) for _ in forced.layers)
    with pytest.warns(UserWarning, match="scale 1.0"):
        make_llm("qwen2-bytes-bf16", kv_cache_dtype="fp8")  # warned at construction, not first generate
    # with checkpoint scales, "fp8" is silent and uses them
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8_kv = modelopt_jax.load(fixture_dir("qwen2-bytes-fp8-kv"), dtype="float32", kv_cache_dtype="fp8")
    assert fp8_kv.kv_cache.scales == llms("qwen2-bytes-fp8-kv").model.kv_cache.scales


def test_forced_fp8_without_scales_cached_and_cacheless_agree(bf16):
    """kv_cache_dtype="fp8" on a checkpoint without k/v scales: both forwards round k/v with scale 1.0.

    (They used to disagree: the cached path rounded, the cache-less one did not, a difference of the
    size of the rounding itself, 0.83 in logits here.) With scale 1.0 many k/v values sit on FP8's
    coarse subnormal grid, so float32 summation order (prefill vs decode shapes) flips a few codes
    at midpoints; measured: median 4.6e-5, max 2.4e-3 per position. Bound: every position within
    1% of the rounding effect, median within 1e-4.
    """
    with pytest.warns(UserWarning, match="scale 1.0"):
        forced = modelopt_jax.load(fixture_dir("qwen2-bytes-bf16"), dtype="float32", kv_cache_dtype="fp8")
    r = references("qwen2-bytes-bf16")[1]
    seq = r["input_ids"] + r["new_token_ids"]
    cached, cache = cached_then_decoded(forced, seq, prefill=7)
    assert cache.is_fp8
    cacheless = np.asarray(forced(jnp.asarray([seq], jnp.int32)))[0]
    per_pos = np.abs(cached - cacheless).max(-1)
    unrounded = np.asarray(bf16.model(jnp.asarray([seq], jnp.int32)))[0]
    rounding = np.abs(cacheless - unrounded).max()
    assert rounding > 0.1
    assert per_pos.max() <= 0.01 * rounding and np.median(per_pos) <= 1e-4, per_pos


def test_numpy_prompts(bf16, sampling_prompt, greedy16):
    """A 1-D numpy array is one prompt (it used to be split into one-token "prompts"); 2-D is a batch."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    (out,) = bf16.generate(np.asarray(sampling_prompt, np.int32), params)
    assert out.token_ids == greedy16 and out.prompt_token_ids == sampling_prompt
    outs = bf16.generate(np.asarray([sampling_prompt, sampling_prompt]), params)
    assert [o.token_ids for o in outs] == [greedy16, greedy16]
