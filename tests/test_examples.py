"""The examples run as scripts and agree with the library."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import modelopt_jax
from modelopt_jax import LLM, SamplingParams

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_jit_generate_matches_llm_generate():
    prompt, n, dtype = "It is a truth", 12, "float32"
    run = subprocess.run([sys.executable, str(EXAMPLES / "jit_generate.py"), "--prompt", prompt, "--max-tokens",
                          str(n), "--dtype", dtype], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"[{n} tokens in" in run.stderr

    llm = LLM(modelopt_jax.demo_checkpoint_path(), dtype=dtype, compilation_cache_dir=None)
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=n))  # greedy, stops at EOS like the script
    assert len(out.token_ids) == n and out.finish_reason == "length"
    assert run.stdout == prompt + out.text + "\n"
