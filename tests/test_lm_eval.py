"""lm-evaluation-harness against the server, as an evaluation pipeline runs it: ``lm_eval --model
local-completions`` with the server's own tokenizer routes (``tokenizer_backend=remote``), a local
multiple-choice task (log-likelihoods: ``echo`` + ``logprobs``) and a local generate_until task, no
network. Every log-likelihood it reports equals the sum of ``LLM.generate``'s prompt log-probs over
the same token ids. Skipped where lm-eval is not installed (``pip install "lm-eval[api]"``; it is not
a test dependency: it pulls datasets, evaluate and more).
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import subprocess
import sys

import pytest

import modelopt_jax
from modelopt_jax import LLM, SamplingParams

TASKS = pathlib.Path(__file__).resolve().parent / "lm_eval_tasks"


def test_lm_eval_scores_through_the_server(tmp_path):
    # Skipped inside the test, not at import: a file whose only module is skipped collects no test,
    # and pytest exits 5 ("no tests collected"), which Bazel's py_test reports as a failure.
    pytest.importorskip("lm_eval")
    pytest.importorskip("uvicorn")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for template in TASKS.glob("*.yaml.in"):
        (tasks / template.name[:-3]).write_text(template.read_text().replace("DATA_DIR", str(TASKS)))
    server = subprocess.Popen([sys.executable, "-m", "modelopt_jax", "serve", "--port", "0", "--quiet", "--dtype",
                               "float32", "--max-model-len", "256", "--served-model-name", "austen"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        line = server.stdout.readline()
        assert line.startswith("serving "), server.stderr.read() if server.poll() is not None else line
        url = line.split(" on ")[-1].strip()
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"model=austen,base_url={url}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,"
             f"num_concurrent=2,max_retries=1", "--tasks", "austen_mc,austen_gen", "--include_path", str(tasks),
             "--output_path", str(tmp_path / "out"), "--log_samples"],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(60)
    results = json.loads(pathlib.Path(glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))[0]).read_text())
    assert set(results["results"]) == {"austen_mc", "austen_gen"}
    llm = LLM(modelopt_jax.demo_checkpoint_path(), dtype="float32", max_model_len=256, compilation_cache_dir=None)
    tok = llm.tokenizer
    scored = 0
    for line in open(glob.glob(str(tmp_path / "out" / "*" / "samples_austen_mc_*.jsonl"))[0]):
        sample = json.loads(line)
        for key, resp in zip(sorted(sample["arguments"]), sample["resps"]):
            context, continuation = sample["arguments"][key]["arg_0"], sample["arguments"][key]["arg_1"]
            ids = tok.encode(context, add_special_tokens=False).ids
            start = len(ids)
            ids += tok.encode(continuation, add_special_tokens=False).ids
            (out,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
            want = sum(out.prompt_logprobs[p][ids[p]] for p in range(start, len(ids)))
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-4), (context, continuation)
            scored += 1
    assert scored == 12
