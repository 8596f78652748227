"""Stop strings and the incremental detokenizer (what streaming reads).

The detokenizer is checked against the tokenizer's own whole-sequence ``decode`` on token runs
that split multi-byte characters and hold special tokens, for the demo's byte-level BPE and for
a SentencePiece-style (Metaspace) tokenizer trained here. Stop strings are checked against an
unstopped greedy run of the same prompt: the text must be that run's text cut before the first
occurrence, and the tokens that run's tokens up to the one that completed it.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import modelopt_jax
from modelopt_jax import LLM, SamplingParams
from modelopt_jax.detokenizer import IncrementalDetokenizer
from modelopt_jax.errors import RequestError, RequestTypeError

PROMPT = "It is a truth universally acknowledged"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(modelopt_jax.demo_checkpoint_path(), dtype="float32", max_model_len=128, compilation_cache_dir=None)


@pytest.fixture(scope="module")
def unstopped(llm):
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=48, ignore_eos=True), use_tqdm=False)
    assert len(out.text) > 30
    return out


def _metaspace_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["It is a truth universally acknowledged, that a single man in possession of a good fortune",
              "must be in want of a wife. Café, naïve, 東京 — déjà vu."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    return tok


def _demo_tokenizer() -> Tokenizer:
    import os

    return Tokenizer.from_file(os.path.join(modelopt_jax.demo_checkpoint_path(), "tokenizer.json"))


@pytest.mark.parametrize("make", [_demo_tokenizer, _metaspace_tokenizer], ids=["byte-level", "metaspace"])
def test_incremental_text_is_the_whole_decode(make):
    tok = make()
    text = "It is a truth, café naïve 東京 — déjà vu. Must be in want of a wife."
    ids = tok.encode(text, add_special_tokens=False).ids
    specials = [tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<s>", "</s>") if tok.token_to_id(t) is not None]
    rng = np.random.default_rng(0)
    for trial in range(20):
        run = list(ids[:rng.integers(1, len(ids) + 1)])
        for _ in range(trial % 3):  # special tokens anywhere: decoded as nothing
            run.insert(int(rng.integers(0, len(run) + 1)), specials[0])
        if trial % 4 == 0:  # end in the middle of a multi-byte character (byte-level) or on an odd id
            run.append(int(rng.integers(0, tok.get_vocab_size())))
        detok = IncrementalDetokenizer(tok)
        pieces = []
        for t in run:
            assert detok.add(t) is False
            pieces.append(detok.take_delta())
            assert "\ufffd" not in pieces[-1] or t == run[-1]
        detok.finish()
        pieces.append(detok.take_delta())
        assert detok.text == "".join(pieces) == tok.decode(run, skip_special_tokens=True), run


def test_stop_string_cuts_the_text_and_ends_the_request(llm, unstopped):
    text = unstopped.text
    stop = text[12:16]  # four characters well inside the output
    at = text.index(stop)
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=48, ignore_eos=True, stop=[stop]), use_tqdm=False)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:at]
    # the tokens: the unstopped run's, up to (and with) the one that completed the stop string
    n = len(out.token_ids)
    assert out.token_ids == unstopped.token_ids[:n]
    assert stop in llm.tokenizer.decode(out.token_ids) and stop not in llm.tokenizer.decode(out.token_ids[:-1])
    assert llm.engine.pool.free == llm.engine.pool.num_pages - 1  # its pages went back in the step it stopped
    (kept,) = llm.generate(PROMPT, SamplingParams(max_tokens=48, ignore_eos=True, stop=stop,
                                                  include_stop_str_in_output=True), use_tqdm=False)
    assert kept.text == text[:at + len(stop)] and kept.token_ids == out.token_ids


def test_stop_strings_are_tried_in_order_and_batched_rows_stop_alone(llm, unstopped):
    text = unstopped.text
    early = text[8:11]
    late = next(text[k:k + 4] for k in range(len(text) - 4, 0, -1) if text.index(text[k:k + 4]) == k)
    assert text.index(early) + len(early) < text.index(late)  # `late` first appears after `early` ends
    params = SamplingParams(max_tokens=48, ignore_eos=True, stop=[late, early])
    # vLLM's rule: the first listed stop string found in a step's new text ends it; here `early`
    # appears (and ends the request) steps before `late` exists
    free = SamplingParams(max_tokens=48, ignore_eos=True)
    out, other = llm.generate([PROMPT, "Emma Woodhouse"], [params, free], use_tqdm=False)
    assert out.text == text[:text.index(early)] and out.stop_reason == early
    assert other.finish_reason == "length" and len(other.token_ids) == 48
    (never,) = llm.generate(PROMPT, SamplingParams(max_tokens=48, ignore_eos=True, stop=["\u00a7never\u00a7"]),
                            use_tqdm=False)
    assert never.text == text and never.finish_reason == "length" and never.stop_reason is None


def test_streamed_pieces_never_show_what_a_stop_string_cuts(llm, unstopped):
    text = unstopped.text
    stop = text[20:27]
    requests = llm.requests(PROMPT, SamplingParams(max_tokens=48, ignore_eos=True, stop=[stop, "zzzzzzzzzzzz"]))
    engine = llm.engine
    engine.add(requests[0])
    pieces = []
    while engine.has_work:
        for r in engine.step():
            pieces.append(r.detokenizer.take_delta())
            assert text.index(stop) >= len("".join(pieces))  # nothing at or past the cut was ever shown
    assert "".join(pieces) == requests[0].detokenizer.text == text[:text.index(stop)]
    assert engine.pool.free == engine.pool.num_pages - 1


def test_stop_token_ids_report_their_id_and_eos_none(llm, unstopped):
    stop = unstopped.token_ids[5]
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=48, ignore_eos=True, stop_token_ids=[stop]), use_tqdm=False)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids[-1] == stop and out.token_ids == unstopped.token_ids[:len(out.token_ids)]


@pytest.mark.parametrize("stop,error,match", [
    ("", RequestError, "must not be empty"), ([""], RequestError, "must not be empty"),
    ([1], RequestTypeError, "stop must hold strings"), (5, RequestTypeError, "stop must be a string or a sequence"),
    (b"x", RequestTypeError, "stop must be a string")])
def test_bad_stop_values_are_typed_errors(stop, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(stop=stop)


def test_stop_values_are_normalized():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(RequestTypeError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(include_stop_str_in_output="yes")


def test_stop_strings_need_a_tokenizer(tmp_path):
    dst = tmp_path / "no-tokenizer"
    shutil.copytree(modelopt_jax.demo_checkpoint_path(), dst)
    (dst / "tokenizer.json").unlink()
    bare = LLM(str(dst), dtype="float32", max_model_len=64, compilation_cache_dir=None)
    with pytest.raises(RequestError, match="stop strings \\['x'\\] need a tokenizer"):
        bare.generate([1, 2, 3], SamplingParams(stop="x"))
