"""``python -m modelopt_jax``: inspect and generate as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

from fixture_paths import fixture_dir
from modelopt_jax.__main__ import main
from modelopt_jax.demo import demo_checkpoint_path


def test_inspect_demo(capsys):
    assert main(["inspect", demo_checkpoint_path()]) == 0
    out = capsys.readouterr().out
    for text in ("Qwen2ForCausalLM", "modelopt 0.47.0", "quant_algo   FP8", "kv_cache     not quantized",
                 "lm_head, model.embed_tokens", "layers 0-3 self_attn.q_proj", "input_scale", "F8_E4M3",
                 "warnings:    none"):
        assert text in out, text


def test_inspect_json_and_unsupported_checkpoint(capsys):
    assert main(["inspect", "--json", str(fixture_dir("qwen2-tiny-nvfp4"))]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quant_algo"] == "NVFP4"
    assert any("cannot be loaded" in w for w in report["warnings"])
    assert report["total_bytes"] == sum(report["tensor_bytes"].values())


def test_inspect_kv_fixture_reports_kv_scales(capsys):
    assert main(["inspect", str(fixture_dir("llama-tiny-fp8-kv"))]) == 0
    out = capsys.readouterr().out
    assert "kv_cache     FP8" in out and "k_scale" in out and "v_scale" in out


def test_bad_path_is_a_clear_error(capsys, tmp_path):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "CheckpointError" in capsys.readouterr().err


def test_generate_on_the_demo_subprocess():
    run = subprocess.run([sys.executable, "-m", "modelopt_jax", "generate", "--prompt", "It is a truth",
                          "--max-tokens", "12", "--ignore-eos"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    text = run.stdout.strip()
    assert text.startswith("It is a truth") and len(text) > len("It is a truth") + 5
    for stage in ("[load] done", "[generate]", "-> 12 new tokens", "tokens/s", "quant_algo   FP8"):
        assert stage in run.stderr, stage


def test_generate_bad_input_is_a_clear_error():
    run = subprocess.run([sys.executable, "-m", "modelopt_jax", "generate", "--max-tokens", "0", "--quiet"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "max_tokens must be a positive integer" in run.stderr


def test_generate_refuses_max_tokens_the_context_cannot_hold(capsys):
    """--max-tokens beyond what --max-model-len leaves after the prompt is an error naming both (the
    server's 400), not a silently shorter answer."""
    assert main(["generate", "--prompt", "Emma", "--max-tokens", "5000", "--max-model-len", "64", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 5000" in err and "--max-model-len 64 leaves room for" in err


def test_generate_several_prompts_with_logprobs(capsys):
    """--prompt and --ids repeat (one batch, outputs in order); --logprobs prints each token's entry."""
    assert main(["generate", "--prompt", "Mr. Darcy", "--prompt", "Emma", "--ids", "1,72,101", "--max-tokens", "3",
                 "--ignore-eos", "--logprobs", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 3 and blocks[0].startswith("Mr. Darcy") and blocks[1].startswith("Emma")
    assert out.count("logprob") == 9 and "top:" in out


def test_generate_arguments_fail_before_the_load(capsys, monkeypatch):
    """Bad sampling values and malformed --ids are typed errors, reported before any inspect/load output."""
    import modelopt_jax.llm as llm_module

    monkeypatch.setattr(llm_module, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    for argv, message in [(["--ids", ""], "--ids '': expected comma-separated integers"),
                          (["--ids", "1,x"], "--ids '1,x'"),
                          (["--top-p", "0"], "top_p must be in (0, 1]"),
                          (["--logprobs", "-1"], "logprobs must be in [0, 1024]"),
                          (["--stop-token-ids", "-5"], "stop_token_ids[...] must be >= 0")]:
        assert main(["generate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "[load]" not in err and "quant_algo" not in err, (argv, err)


def test_generate_help_shows_defaults(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "(default: 64)" in out and "{off,auto,require}" in out
    assert "(default: None)" not in out  # options without a default say what happens instead
    for option in ("--top-p", "--seed", "--tensor-parallel-size"):  # argparse shows no default without help
        block = out[out.index(f"  {option} "):].split("\n  --")[0]
        assert "default:" in block, block


def test_generate_streams_each_prompt_as_its_tokens_arrive(monkeypatch):
    """The text reaches stdout token by token while the engine still generates (recorded with how many
    tokens each request had at every write), prompts in order, and it is exactly LLM.generate's output."""
    from modelopt_jax import LLM, SamplingParams
    from modelopt_jax.__main__ import _stream_to_stdout

    llm = LLM(demo_checkpoint_path(), dtype="float32", max_model_len=128, compilation_cache_dir=None)
    prompts, params = ["It is a truth", "Emma", [256, 72, 101]], SamplingParams(max_tokens=12, ignore_eos=True)
    want = llm.generate(prompts, params, use_tqdm=False)
    requests = llm.requests(prompts, params, detokenize=True)
    writes = []

    class Recorder:
        def write(self, text):
            writes.append((text, [len(r.generated) for r in requests]))

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Recorder())
    _stream_to_stdout(llm.engine, requests, prompts, logprobs=False)
    assert "".join(t for t, _ in writes) == \
        f"It is a truth{want[0].text}\n\nEmma{want[1].text}\n\n{want[2].text}\n"
    during = [counts[0] for text, counts in writes if text and counts[0] < 12]
    # prompt 0: a write per launch (one token, or a multi-step launch's tokens), mid-generation
    assert len(during) >= 11 // llm.engine.config.decode_steps and during == sorted(during)
    assert llm.engine.pool.free == llm.engine.pool.num_pages - 1


def test_prefix_caching_flag_takes_vllms_spelling_too(capsys, monkeypatch):
    """``--no-prefix-caching`` and vLLM's ``--no-enable-prefix-caching`` both reach the LLM as
    ``enable_prefix_caching=False`` (a command line copied from ``vllm serve`` keeps its meaning);
    without either it is on."""
    import pytest

    import modelopt_jax

    seen = []

    class Refuse(Exception):
        pass

    def fake_llm(path, **options):
        seen.append(options["enable_prefix_caching"])
        raise Refuse

    monkeypatch.setattr(modelopt_jax, "LLM", fake_llm)
    for flag in (["--no-prefix-caching"], ["--no-enable-prefix-caching"], []):
        with pytest.raises(Refuse):
            main(["generate", "--quiet", *flag])
    assert seen == [False, False, True]
