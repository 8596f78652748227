"""Greedy continuations of the trained byte-level model vs the references in reference.json.

Teacher-forced (feed prompt + reference tokens, compare the argmax at every generated position):
every position where the reference's top1-top2 margin exceeds 0.5 must agree -- a flip there would
be a real numerical error, not a near-tie. Free-running agreement is also checked (first
divergence may only happen at a near-tie).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import modelopt_jax
from fixture_paths import fixture_dir
from modelopt_jax.greedy import greedy_continue, jit_forward


@pytest.mark.parametrize("name", ["qwen2-bytes-bf16", "qwen2-bytes-fp8", "qwen2-bytes-fp8-kv", "qwen2-bytes-fp8-pc-pt"])
def test_teacher_forced_and_free_running(name):
    d = fixture_dir(name)
    results = json.loads((d / "reference.json").read_text())["results"]
    model = modelopt_jax.load(d, dtype="float32")
    forward, state = jit_forward(model)
    for r in results:
        prompt, ref_new = r["input_ids"], r["new_token_ids"]
        margins = np.asarray(r["top1_minus_top2_logit"])
        logits = np.asarray(forward(state, jnp.asarray([prompt + ref_new], jnp.int32)))[0]
        pred = logits[len(prompt) - 1:-1].argmax(-1)
        decisive = margins > 0.5
        assert (pred[decisive] == np.asarray(ref_new)[decisive]).all(), f"{name} {r['prompt']!r}"
        free = greedy_continue(model, prompt, len(ref_new))
        diverge = next((i for i, (a, b) in enumerate(zip(free, ref_new)) if a != b), None)
        assert diverge is None or margins[diverge] < 0.5, f"{name} {r['prompt']!r} diverges at {diverge}"
