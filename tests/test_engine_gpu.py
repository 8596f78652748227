"""The engine on a GPU, end to end through ``LLM.generate``: decode steps whose attention kernel
writes the step's keys/values itself (``AttentionConfig.decode="fused_kernel"``, the default on
CUDA) generate exactly what the same engine generates with a scatter per pool first (``"kernel"``), on a synthetic ModelOpt FP8 Llama whose
heads (d = 64) the CUDA kernels serve, bf16 and FP8 pages, with requests of ragged lengths that
wait, run and finish at different steps. Both runs read identical pool bytes, so tokens and
log-probs are equal, not close.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from modelopt_jax import LLM, SamplingParams
from modelopt_jax.engine import Engine
from modelopt_jax.ops import native
from modelopt_jax.synthetic import write_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA decode write kernel not built")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("fused_write") / "ckpt"
    write_checkpoint(d, family="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, kv_cache_fp8=True, seed=3)
    return str(d)


def _generate(checkpoint, kv_cache_dtype, decode):
    llm = LLM(checkpoint, kv_cache_dtype=kv_cache_dtype, max_model_len=1024, kv_cache_bytes=64 << 20,
              max_num_seqs=16)
    assert llm.engine.runner.attention.decode == "fused_kernel"  # what CUDA resolves to
    if decode != "fused_kernel":
        old, llm.engine = llm.engine, None
        llm.engine = Engine(llm.model, max_model_len=old.max_model_len, pad_id=old.runner.pad_id, config=old.config,
                            attention=llm.model.attention_config(old.config.page_size, decode=decode))
        del old
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, int(n)).tolist() for n in rng.integers(1, 400, 40)]
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True, logprobs=2) for n in rng.integers(1, 60, 40)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, [sorted(d.items()) for d in o.logprobs]) for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8"])
def test_fused_page_write_generates_what_scatter_then_attend_does(checkpoint, kv_cache_dtype):
    fused = _generate(checkpoint, kv_cache_dtype, "fused_kernel")
    unfused = _generate(checkpoint, kv_cache_dtype, "kernel")
    assert len(fused) == 40
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert a[0] == b[0], f"prompt {i}: tokens differ"
        assert a[1] == b[1], f"prompt {i}: log-probs differ"


def _compare_until_they_part(runs_a, runs_b, params, bound: float = 0.25) -> int:
    """Walks two runs' completions (``CompletionOutput`` lists, request by request) token by token up
    to where they first differ, and returns how many tokens agreed. At each position the log-probs
    of the tokens both runs report (the chosen one and the top 2) agree within ``bound`` (bf16/FP8
    noise); where a greedy row's picks first differ they are a near-tie (each run's top log-prob within
    ``bound`` of the other's), so neither chose a token the other found unlikely, whether or not the
    two runs' top 2 there share a token. A sampled pick is a
    draw from the CDF, which a small shift can move to any token beside it: only the shared tokens'
    log-probs are compared there."""
    compared = 0
    for a, b, p in zip(runs_a, runs_b, params, strict=True):
        for ca, cb in zip(a, b, strict=True):
            for i, (ta, tb) in enumerate(zip(ca.token_ids, cb.token_ids)):
                # Where the picks are equal the chosen token is common. Where they part, the two top-2
                # sets may share nothing: on nearly flat logits a 0.05 shift reorders the top few.
                common = ca.logprobs[i].keys() & cb.logprobs[i].keys()
                for t in common:
                    assert abs(ca.logprobs[i][t] - cb.logprobs[i][t]) < bound, (i, t, ca.logprobs[i], cb.logprobs[i])
                if not p.temperature:
                    assert abs(ca.logprobs[i][ta] - cb.logprobs[i][tb]) < bound, (i, ca.logprobs[i], cb.logprobs[i])
                if ta != tb:
                    break
                compared += 1
    return compared


def _mixed_run(checkpoint, split_steps, precompile, packed_steps=False, **overrides):
    llm = LLM(checkpoint, max_model_len=1024, kv_cache_bytes=64 << 20, max_num_seqs=16, compilation_cache_dir=None,
              precompile=False)
    old, llm.engine = llm.engine, None
    config = dataclasses.replace(old.config, split_steps=split_steps, packed_steps=packed_steps,
                                 max_num_batched_tokens=512,
                                 precompile_samplers=("greedy",) if precompile else (), **overrides)
    del old
    llm.engine = Engine(llm.model, max_model_len=1024, pad_id=llm.model.config.pad_token_id or 0, config=config)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 1000, int(n)).tolist() for n in rng.integers(2, 600, 30)]
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True, logprobs=2) for n in rng.integers(2, 40, 30)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, dict(llm.engine.last_stats), llm.engine


def test_split_mixed_steps_with_the_kernels_generate_what_one_program_does(checkpoint):
    """On CUDA, mixed steps as a decode program and a prompt program (prompt chunks in PROMPT_TILE
    rows), with the program table compiled at start-up: every program the run meets has a shape of
    the table (these requests ask for log-probs, which the table leaves to first use), and the tokens
    are the one-program steps' (the GEMMs see other M, so FP8 activations may round differently)."""
    split, stats, engine = _mixed_run(checkpoint, True, True)
    one, one_stats, _ = _mixed_run(checkpoint, False, False)
    table = engine.runner.program_table(512)
    assert engine.precompiled == len(table)
    assert {p.shape for p in engine.runner.shapes} <= {p.shape for p in table}
    assert stats["mixed_steps"] > 0 and one_stats["mixed_steps"] > 0
    # The synthetic model's logits are nearly flat (top-2 margins mostly under 0.3), so a token may
    # differ between the runs (greedy rows: a near-tie where they part).
    first_equal = sum(g.token_ids[:1] == w.token_ids[:1] for g, w in zip(split, one))
    compared = _compare_until_they_part([g.outputs for g in split], [w.outputs for w in one],
                                        [SamplingParams()] * len(one))
    print(f"first tokens equal {first_equal}/{len(one)}, tokens compared {compared}")
    assert compared >= len(one)


def test_packed_mixed_steps_with_the_kernels_generate_what_split_steps_do(checkpoint):
    """On CUDA, the packed layout: a step with prompt chunks runs as one program of
    token_bucket(decodes + prompt tokens) tokens, the decode kernel over its decode section (unused
    rows given no keys) and the prefill kernel over the whole step, from the start-up table; the
    tokens are the split steps' up to near-ties (the GEMMs see other M)."""
    packed, stats, engine = _mixed_run(checkpoint, True, True, packed_steps=True)
    split, _, _ = _mixed_run(checkpoint, True, True)
    table = engine.runner.program_table(512)
    assert engine.precompiled == len(table)
    assert {p.shape for p in engine.runner.shapes} <= {p.shape for p in table}
    ran = [p.shape for p in engine.runner.shapes if p.shape.prompt_tokens]
    assert stats["mixed_steps"] > 0 and ran and all(s.packed for s in ran)
    compared = _compare_until_they_part([g.outputs for g in packed], [w.outputs for w in split],
                                        [SamplingParams()] * len(packed))
    print(f"packed shapes {sorted(s.tokens for s in ran)}, tokens compared {compared}")
    assert compared >= len(packed)


def test_cascade_attention_generates_what_plain_decode_steps_do(checkpoint):
    """On CUDA, 24 requests behind one 300-token system prompt (and 6 without it), 4 samples each
    of two of them: with cascade attention (the default here) the shared prompt's pages are read once
    per group of decode rows, and the tokens are the plain decode kernel's up to near-ties (bf16
    attention summed in another order)."""
    rng = np.random.default_rng(4)
    system = rng.integers(10, 1000, 300).tolist()
    prompts = [system + rng.integers(10, 1000, int(n)).tolist() for n in rng.integers(1, 80, 24)]
    prompts += [rng.integers(10, 1000, int(n)).tolist() for n in rng.integers(2, 300, 6)]
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True, logprobs=2) for n in rng.integers(8, 40, 30)]
    params[0] = params[3] = SamplingParams(max_tokens=20, n=4, temperature=0.7, seed=5, logprobs=2)
    runs = {}
    for group in (None, 0):
        llm = LLM(checkpoint, max_model_len=1024, kv_cache_bytes=64 << 20, max_num_seqs=32,
                  compilation_cache_dir=None, precompile=False)
        if group is None:
            assert llm.engine.runner.attention.cascade_group == 16  # 64 // (8 heads / 2 kv heads)
        else:
            old, llm.engine = llm.engine, None
            llm.engine = Engine(llm.model, max_model_len=1024, pad_id=old.runner.pad_id, config=old.config,
                                attention=llm.model.attention_config(old.config.page_size, cascade_group=0))
            del old
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[group] = (outs, dict(llm.engine.last_stats))
    (cascade, stats), (plain, plain_stats) = runs[None], runs[0]
    assert stats["shared_prefix_rows"] > 0 and plain_stats["shared_prefix_rows"] == 0
    compared = _compare_until_they_part([g.outputs for g in cascade], [w.outputs for w in plain], params)
    print(f"cascade rows {stats['shared_prefix_rows']}, tokens compared {compared}")
    assert compared >= len(prompts)
