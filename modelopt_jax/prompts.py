"""Prompts -> validated engine requests: the tokenizer, chat templates and the checks that need
only the checkpoint's config, not its weights.

One :class:`PromptProcessor` serves :class:`~modelopt_jax.LLM` (beside its engine) and the
server's frontend process (which never loads the weights: the engine core does), so a prompt is
tokenized, checked and split into samples the same way wherever it is generated from.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import numpy as np

from modelopt_jax.chat_template import ChatTemplate, conversations
from modelopt_jax.checkpoint.hf_config import eos_ids
from modelopt_jax.detokenizer import IncrementalDetokenizer
from modelopt_jax.engine.request import Request
from modelopt_jax.errors import CheckpointError, InvalidArgumentError, RequestError, RequestTypeError
from modelopt_jax.request_keys import sample_keys, seed_keys
from modelopt_jax.sampling import SamplingParams


def resolve_max_model_len(config, max_model_len: int | None) -> int:
    """``max_model_len`` checked against the model's ``max_position_embeddings`` (None: that, at most 4096)."""
    limit = config.max_position_embeddings
    if max_model_len is None:
        max_model_len = min(limit, 4096)
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, (int, np.integer)) or \
            not 1 < max_model_len <= limit:
        raise InvalidArgumentError(f"max_model_len={max_model_len!r} must be an integer in [2, {limit}] (the "
                                   f"model's max_position_embeddings), or None for min({limit}, 4096)")
    return int(max_model_len)


class PromptProcessor:
    """The request side of a checkpoint at ``path``: ``config`` is its model config (vocabulary,
    BOS), ``max_model_len`` the bound on prompt + generated tokens, ``tokenizer`` a tokenizer.json
    (a file or a directory holding one; None: the checkpoint's own, if it has one, else prompts
    must be token ids)."""

    def __init__(self, path: str, config, max_model_len: int, tokenizer: str | os.PathLike | None = None):
        self.path, self.config, self.max_model_len = path, config, int(max_model_len)
        tokenizer_path = self._tokenizer_path(tokenizer)
        # chat templates and special tokens sit beside the tokenizer.json in use (tokenizer_config.json)
        self._tokenizer_dir = os.path.dirname(tokenizer_path) if tokenizer_path is not None else self.path
        self._chat_templates: dict[str | None, ChatTemplate] = {}
        self.tokenizer = self._load_tokenizer(tokenizer_path)
        self.eos_token_ids = eos_ids(self.path)

    def _tokenizer_path(self, tokenizer) -> str | None:
        """The tokenizer.json to use: ``tokenizer=`` (a file or a directory holding one) must exist;
        without it, the checkpoint's own, if it has one (else prompts must be token ids)."""
        if tokenizer is None:
            path = os.path.join(self.path, "tokenizer.json")
            return path if os.path.isfile(path) else None
        path = os.fspath(tokenizer)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise InvalidArgumentError(f"tokenizer={os.fspath(tokenizer)!r}: no tokenizer.json there (pass the file "
                                       f"or a directory holding it)")
        return path

    @staticmethod
    def _load_tokenizer(path: str | None):
        if path is None:
            return None
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception on a malformed file
            raise CheckpointError(f"{path}: not a readable tokenizer.json ({e})") from e

    @functools.cached_property
    def longest_token_chars(self) -> int | None:
        """Characters of the longest token's text (None without a tokenizer). Read from the vocabulary's
        own strings: byte-level vocabularies spell one character per byte, so this bounds characters too."""
        if self.tokenizer is None:
            return None
        return max((len(token) for token in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """The most characters a text prompt can have and still fit ``max_model_len`` tokens, so longer
        ones are refused before tokenizing them (which can take minutes and gigabytes for megabytes of
        text). Sound when every character becomes part of some token: a tokenizer that drops characters
        (whitespace-splitting word vocabularies, normalizers that strip) could fit more, so for one
        that drops any of a probe's characters there is no bound (None) and only the exact count decides."""
        if self.tokenizer is None:
            return None
        probe = " " * 64 + "\t\n\r" * 8 + "\u200b\u00a0\u3000\x00\x7f" * 8 + "a " * 16 + "\ufeff" * 8
        tokens = len(self.tokenizer.encode(probe, add_special_tokens=False).ids)
        if tokens * self.longest_token_chars < len(probe):
            return None
        return self.max_model_len * self.longest_token_chars

    def check_prompt_chars(self, what: str, text: str) -> None:
        bound = self.max_prompt_chars
        if bound is not None and len(text) > bound:
            raise RequestError(f"{what} has {len(text)} characters: more than max_model_len={self.max_model_len} "
                               f"tokens of at most {self.longest_token_chars} characters each can hold (refused "
                               f"before tokenizing)")

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids as :meth:`generate` feeds them (with ``add_special_tokens``: the
        tokenizer's own special tokens, and the BOS where the tokenizer adds none)."""
        if not isinstance(text, str):
            raise RequestTypeError(f"tokenize: text must be a string, got {type(text).__name__}")
        if not add_special_tokens:
            if self.tokenizer is None:
                raise RequestError(f"{self.path} has no tokenizer.json: pass LLM(..., tokenizer=...)")
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return self._encode(0, text)[1]

    def _encode(self, index: int, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            keys = set(prompt)
            if keys == {"prompt"}:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise RequestTypeError(f"prompt {index}: 'prompt' must be a string, got {type(prompt).__name__}")
            elif keys == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
                if isinstance(prompt, str):
                    raise RequestTypeError(f"prompt {index}: 'prompt_token_ids' must be a list of token ids, not a str")
            else:
                raise RequestError(f"prompt {index}: a dict prompt holds exactly one of 'prompt' (text) or "
                                   f"'prompt_token_ids' (ids); got keys {sorted(map(str, keys))}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"prompt {index} is text but {self.path} has no tokenizer.json: pass token-id "
                                   f"lists, or LLM(..., tokenizer=...)")
            self.check_prompt_chars(f"prompt {index}", prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=True).ids
            bos = self.config.bos_token_id
            if bos is not None and ids and ids[0] != bos:
                ids = [bos] + ids  # tokenizers that add no BOS themselves (e.g. the byte-level demo)
            return prompt, ids
        ids = _token_ids(prompt)
        if ids is not None:
            return None, ids
        raise RequestTypeError(f"prompt {index} must be a string, a list of token ids or a dict with 'prompt' / "
                               f"'prompt_token_ids', got {type(prompt).__name__}")

    def special_tokens(self) -> dict[str, str]:
        """The named special tokens (``bos_token``, ``eos_token``, ...) as strings: the tokenizer's
        config where it names them, else the text of the config's BOS / first EOS id."""
        from modelopt_jax.chat_template import special_tokens

        out = special_tokens(self._tokenizer_dir)
        if self.tokenizer is not None:
            bos = self.config.bos_token_id
            if "bos_token" not in out and bos is not None:
                out["bos_token"] = self.tokenizer.decode([bos], skip_special_tokens=False)
            if "eos_token" not in out and self.eos_token_ids:
                out["eos_token"] = self.tokenizer.decode([min(self.eos_token_ids)], skip_special_tokens=False)
        return out

    def get_chat_template(self, chat_template: str | None = None) -> ChatTemplate:
        """The checkpoint's chat template (or ``chat_template``: source, a file or a name), compiled once."""
        if chat_template is not None and not isinstance(chat_template, str):
            raise RequestTypeError(f"chat_template must be a string (Jinja source, a file or a template name), "
                                   f"got {type(chat_template).__name__}")
        if chat_template not in self._chat_templates:
            self._chat_templates[chat_template] = ChatTemplate.from_checkpoint(self._tokenizer_dir, chat_template)
        return self._chat_templates[chat_template]

    def chat_requests(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                      chat_template: str | None = None, add_generation_prompt: bool = True,
                      detokenize: bool = False) -> list[Request]:
        """Validated engine requests for the conversations in ``messages`` (see :meth:`chat`), not run."""
        if self.tokenizer is None:
            raise RequestError(f"chat needs a tokenizer, and {self.path} has no tokenizer.json: pass "
                               f"LLM(..., tokenizer=...)")
        if not isinstance(add_generation_prompt, (bool, np.bool_)):
            raise RequestTypeError(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}")
        convs, _ = conversations(messages)
        template = self.get_chat_template(chat_template)
        texts = [template.render(conv, add_generation_prompt=add_generation_prompt) for conv in convs]
        for i, text in enumerate(texts):
            self.check_prompt_chars(f"conversation {i} (as the chat template renders it)", text)
        ids = [self.tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
        requests = self.requests([{"prompt_token_ids": i} for i in ids], sampling_params, detokenize=detokenize)
        for request, text in zip(requests, texts):
            request.prompt = text
        return requests

    def requests(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 detokenize: bool = False) -> list[Request]:
        """Validated engine requests for ``prompts`` (the forms :meth:`generate` takes), without running
        them: for callers that drive :class:`~modelopt_jax.engine.Engine` step by step (the server).
        ``detokenize`` gives every request an incremental detokenizer (``request.detokenizer``), so a
        caller can stream its text; requests with stop strings always get one.
        Raises what :meth:`generate` raises for bad input."""
        # One prompt: a string, a dict, or a flat sequence of ids. A 1-D numpy array counts too
        # (without this, a single array prompt was split into one-int "prompts" and failed).
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts) > 0
                                                      and isinstance(prompts[0], (int, np.integer)))
        if not single and not isinstance(prompts, (list, tuple, np.ndarray)):
            raise RequestTypeError(f"generate(prompts): a prompt or a list of prompts, got {type(prompts).__name__}")
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            raise RequestError("generate(prompts): no prompts given")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise RequestTypeError(f"sampling_params{'' if len(params) == 1 else f'[{i}]'} must be a "
                                       f"SamplingParams, got {type(p).__name__}")
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        encoded = [self._encode(i, p) for i, p in enumerate(prompts)]
        vocab = self.config.vocab_size
        for i, (_, ids) in enumerate(encoded):
            if not ids:
                raise RequestError(f"prompt {i} is empty (no tokens)")
            if len(ids) >= self.max_model_len:
                raise RequestError(f"prompt {i} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no "
                                   f"room to generate")
            if min(ids) < 0 or max(ids) >= vocab:
                raise RequestError(f"prompt {i} has token ids outside [0, {vocab})")
        for i, p in enumerate(params):
            for name in ("logprobs", "prompt_logprobs"):
                if (getattr(p, name) or 0) > vocab:
                    raise RequestError(f"sampling_params: {name}={getattr(p, name)} exceeds the vocabulary ({vocab})")
            if any(t >= vocab for t in p.stop_token_ids):
                raise RequestError(f"sampling_params: stop_token_ids {list(p.stop_token_ids)} reach outside the "
                                   f"vocabulary [0, {vocab})")
            if p.stop and self.tokenizer is None:
                raise RequestError(f"sampling_params: stop strings {list(p.stop)} need a tokenizer and {self.path} "
                                   f"has none (use stop_token_ids, or LLM(..., tokenizer=...))")
        # every sample's PRNG key at once (request_keys: jax.random's functions, in numpy)
        seeds = [p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little") for p in params]
        counts = [p.best_of or p.n for p in params]
        owner = np.repeat(np.arange(len(params)), counts)
        sample = np.concatenate([np.arange(c) for c in counts])
        keys = sample_keys(seed_keys(seeds)[owner], sample)
        firsts = np.cumsum([0] + counts[:-1])
        return [request for i, ((text, ids), p) in enumerate(zip(encoded, params))
                for request in self._samples(i, text, ids, p, detokenize, keys[firsts[i]:firsts[i] + counts[i]])]

    def _samples(self, index: int, text, ids: list[int], params: SamplingParams, detokenize: bool,
                 keys: np.ndarray) -> list[Request]:
        """The engine requests of one prompt: one per sample (``best_of`` or ``n``), ``keys`` [samples, 2]
        their raw PRNG keys: sample 0 draws from the request's own key (as n = 1 does), sample s
        from that key folded with s. Only sample 0 computes the prompt's log-probs, so the others
        can start from its cached pages."""
        stop = frozenset(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)))
        budget = min(params.max_tokens, self.max_model_len - len(ids))
        samples = []
        for s in range(params.best_of or params.n):
            detokenizer = None
            if self.tokenizer is not None and (detokenize or params.stop):
                detokenizer = IncrementalDetokenizer(self.tokenizer, stop=params.stop,
                                                     include_stop_str_in_output=params.include_stop_str_in_output)
            sample_params = params if s == 0 or params.prompt_logprobs is None else \
                dataclasses.replace(params, prompt_logprobs=None)
            samples.append(Request(index, text, ids, sample_params, stop, budget, keys[s].copy(),
                                   detokenizer=detokenizer, sample_index=s))
        return samples


_INTEGER_TYPES = (int, np.integer)


def _token_ids(prompt) -> list[int] | None:
    """``prompt`` as a list of Python ints where it is a sequence of integers (bools are not token
    ids), else None. By the set of element types (one pass in C), not a Python check per token: a
    1000-prompt workload of 1,600 tokens each spent most of a second here."""
    if isinstance(prompt, np.ndarray):
        return prompt.tolist() if prompt.ndim == 1 and prompt.dtype.kind in "iu" else None
    if not isinstance(prompt, (list, tuple)):
        return None
    types = set(map(type, prompt))
    if types <= {int}:
        return list(prompt)
    if all(issubclass(t, _INTEGER_TYPES) and not issubclass(t, (bool, np.bool_)) for t in types):
        return [int(t) for t in prompt]
    return None
