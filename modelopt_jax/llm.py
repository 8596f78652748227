"""``LLM(model).generate(prompts, SamplingParams(...))``: generation through the engine.

Prompts become requests of :mod:`modelopt_jax.engine`: a page pool sized from a memory budget,
continuous batching (requests are admitted while pages are free, finished ones free theirs at
once, long prompts are prefilled in chunks, and a request is preempted and later recomputed when
pages run out), sampling on the device. Shapes are bucketed so a workload compiles a handful of
programs, and JAX's persistent compilation cache keeps them across processes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.chat_template import ChatTemplate, conversations
from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.demo import demo_checkpoint_path
from modelopt_jax.detokenizer import IncrementalDetokenizer
from modelopt_jax.engine import Engine, EngineConfig, RequestOutput
from modelopt_jax.errors import (ArgumentTypeError, CheckpointError, ConfigError, InvalidArgumentError, RequestError,
                                 RequestTypeError)
from modelopt_jax.engine.request import Request
from modelopt_jax.checkpoint.hf_config import eos_ids
from modelopt_jax.loader import WeightCacheOptions, load
from modelopt_jax.sampling import SamplingParams

QUANTIZATIONS = ("modelopt", None)


def enable_compilation_cache(directory: str | None = "auto") -> str | None:
    """Turns on JAX's persistent compilation cache (unless the user configured one already)."""
    if directory is None or directory is False:
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    if directory == "auto":
        directory = os.environ.get("MODELOPT_JAX_COMPILATION_CACHE",
                                   os.path.join(os.path.expanduser("~"), ".cache", "modelopt_jax", "xla"))
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return directory


class LLM:
    """A loaded model plus tokenizer, ready to generate.

    ``quantization="modelopt"`` requires a ModelOpt checkpoint (clear error otherwise);
    ``None`` loads whatever the checkpoint is. ``kv_cache_dtype``: ``"auto"`` (FP8 when the
    checkpoint has k/v scales, else the compute dtype), ``"fp8"``, ``"bfloat16"``, ``"float16"``,
    ``"float32"``. ``max_model_len`` bounds prompt + generated tokens (default: the model's
    ``max_position_embeddings``, at most 4096). ``tensor_parallel_size`` splits the model over
    that many local devices (see :mod:`modelopt_jax.parallel`). ``weight_cache`` ("off", "auto",
    "require"), ``weight_cache_dir`` and ``weight_cache_timeout`` attach to a weight-cache daemon
    (see :func:`modelopt_jax.load`). The engine (:class:`modelopt_jax.engine.EngineConfig`): the KV
    page pool takes ``kv_cache_memory_fraction`` of the device (after the weights) or
    ``kv_cache_bytes``; at most ``max_num_seqs`` requests run at once (None: 512 where the pool
    holds 512 sequences of 1024 tokens, as on an 80-141 GB GPU, else 256), a step carries every
    running request's next token plus prompt chunks up to ``max_num_batched_tokens`` tokens in all,
    and ``enable_prefix_caching`` lets prompts that start alike share the cached pages of their
    common prefix (computed once, kept after their requests end, evicted least recently used).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, quantization: str | None = "modelopt",
                 dtype: str = "bfloat16", max_model_len: int | None = None, kv_cache_dtype: str = "auto",
                 backend: str = "auto", tokenizer: str | os.PathLike | None = None,
                 compilation_cache_dir: str | None = "auto", tensor_parallel_size: int = 1,
                 weight_cache: str = "off", weight_cache_dir: str | os.PathLike | None = None,
                 weight_cache_timeout: float | None = None, kv_cache_memory_fraction: float = 0.9,
                 kv_cache_bytes: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
                 enable_prefix_caching: bool = True, **unknown: Any):
        if unknown:
            raise ArgumentTypeError(f"LLM() got unexpected keyword argument(s) {sorted(unknown)}; supported: model, "
                            f"quantization, dtype, max_model_len, kv_cache_dtype, backend, tokenizer, "
                            f"compilation_cache_dir, tensor_parallel_size, weight_cache, weight_cache_dir, "
                            f"weight_cache_timeout, kv_cache_memory_fraction, kv_cache_bytes, max_num_seqs, "
                            f"max_num_batched_tokens, enable_prefix_caching")
        engine_config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     enable_prefix_caching=enable_prefix_caching,
                                     kv_cache_memory_fraction=kv_cache_memory_fraction, kv_cache_bytes=kv_cache_bytes)
        if quantization not in QUANTIZATIONS:
            raise InvalidArgumentError(f"quantization={quantization!r} not supported; use 'modelopt' or None (detect)")
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or \
                tensor_parallel_size < 1:
            raise InvalidArgumentError(f"tensor_parallel_size={tensor_parallel_size!r} must be a positive integer")
        self.path = os.fspath(model) if model is not None else demo_checkpoint_path()
        ckpt = Checkpoint.open(self.path)  # opened once: load() takes it from here
        # Arguments that only the config bounds are checked before the weights load.
        limit = ckpt.model_config.max_position_embeddings
        if max_model_len is None:
            max_model_len = min(limit, 4096)
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, (int, np.integer)) or \
                not 1 < max_model_len <= limit:
            raise InvalidArgumentError(f"max_model_len={max_model_len!r} must be an integer in [2, {limit}] (the "
                                       f"model's max_position_embeddings), or None for min({limit}, 4096)")
        self.max_model_len = int(max_model_len)
        tokenizer_path = self._tokenizer_path(tokenizer)
        # chat templates and special tokens sit beside the tokenizer.json in use (tokenizer_config.json)
        self._tokenizer_dir = os.path.dirname(tokenizer_path) if tokenizer_path is not None else self.path
        self._chat_templates: dict[str | None, ChatTemplate] = {}
        self.compilation_cache_dir = enable_compilation_cache(compilation_cache_dir)
        if quantization == "modelopt":
            if not ckpt.quant_config.is_quantized:
                raise ConfigError(f"{self.path}: quantization='modelopt' but this is not a ModelOpt checkpoint "
                                  f"(no hf_quant_config.json, no quantization_config with quant_method 'modelopt'); "
                                  f"pass quantization=None to load it unquantized")
        mesh = None
        if tensor_parallel_size != 1:
            from modelopt_jax.parallel import make_mesh

            mesh = make_mesh(tensor_parallel_size)
        t0 = time.perf_counter()
        self.model = load(ckpt, dtype=dtype, backend=backend, mesh=mesh, kv_cache_dtype=kv_cache_dtype,
                          weight_cache=WeightCacheOptions(weight_cache, None if weight_cache_dir is None else
                                                          os.fspath(weight_cache_dir), weight_cache_timeout))
        self.load_seconds = time.perf_counter() - t0
        self.tokenizer = self._load_tokenizer(tokenizer_path)
        self.eos_token_ids = eos_ids(self.path)
        self.engine = Engine(self.model, max_model_len=self.max_model_len, config=engine_config,
                             pad_id=self.model.config.pad_token_id or 0)
        self.last_stats: dict[str, float] = {}

    @property
    def kv_cache_dtype(self) -> str:
        """What was asked for (``model.kv_cache`` says what it resolved to)."""
        return self.model.kv_cache.requested

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

    # ---- request handling -----------------------------------------------------------------------
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
            ids = self.tokenizer.encode(prompt, add_special_tokens=True).ids
            bos = self.model.config.bos_token_id
            if bos is not None and ids and ids[0] != bos:
                ids = [bos] + ids  # tokenizers that add no BOS themselves (e.g. the byte-level demo)
            return prompt, ids
        if isinstance(prompt, (list, tuple, np.ndarray)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise RequestTypeError(f"prompt {index} must be a string, a list of token ids or a dict with 'prompt' / "
                               f"'prompt_token_ids', got {type(prompt).__name__}")

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, **unknown: Any) -> list[RequestOutput]:
        """Generates for one prompt or a list; returns one output each, in order.

        A prompt is a string, a list of token ids, or vLLM's dict form (``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}``). ``sampling_params``: one :class:`SamplingParams` for all, or
        one per prompt. ``use_tqdm`` shows a progress bar over finished requests (on stderr, when
        tqdm is installed). Bad input raises :class:`~modelopt_jax.errors.RequestError` (a
        ``ValueError``; ``RequestTypeError`` for wrong types) before any work starts.
        """
        if unknown:
            raise RequestTypeError(f"generate() got unexpected keyword argument(s) {sorted(unknown)}")
        return self._run(self.requests(prompts, sampling_params), use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True, use_tqdm: bool = True,
             **unknown: Any) -> list[RequestOutput]:
        """Generates the next assistant message of one conversation or of a list of them (vLLM's ``chat``).

        ``messages``: a list of ``{"role": ..., "content": ...}`` dicts, or a list of such lists.
        Each conversation is rendered with the checkpoint's chat template (``chat_template.jinja`` or
        ``tokenizer_config.json``'s), as transformers' ``apply_chat_template`` renders it, and
        tokenized without adding special tokens (the template writes them). ``chat_template``: Jinja
        source, a file, or the name of one of the checkpoint's templates, instead of the default.
        ``add_generation_prompt`` appends the template's assistant header. Returns one output per
        conversation; ``output.prompt`` is the rendered text. A missing template, malformed messages
        or a template that raises are :class:`~modelopt_jax.errors.RequestError` subclasses
        (:class:`~modelopt_jax.errors.ChatTemplateError` for the template's own failures).
        """
        if unknown:
            raise RequestTypeError(f"chat() got unexpected keyword argument(s) {sorted(unknown)}")
        return self._run(self.chat_requests(messages, sampling_params, chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt), use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        """Runs validated requests to the end (a progress bar for more than one); outputs in order."""
        outputs = self.engine.run(requests, tokenizer=self.tokenizer, use_tqdm=use_tqdm and len(requests) > 1)
        self.last_stats = self.engine.last_stats
        return outputs

    def special_tokens(self) -> dict[str, str]:
        """The named special tokens (``bos_token``, ``eos_token``, ...) as strings: the tokenizer's
        config where it names them, else the text of the config's BOS / first EOS id."""
        from modelopt_jax.chat_template import special_tokens

        out = special_tokens(self._tokenizer_dir)
        if self.tokenizer is not None:
            bos = self.model.config.bos_token_id
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
        vocab = self.model.config.vocab_size
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
        return [request for i, ((text, ids), p) in enumerate(zip(encoded, params))
                for request in self._samples(i, text, ids, p, detokenize)]

    def _samples(self, index: int, text, ids: list[int], params: SamplingParams, detokenize: bool) -> list[Request]:
        """The engine requests of one prompt: one per sample (``best_of`` or ``n``). Sample 0 draws
        from the request's own key (as n = 1 does), sample s from that key folded with s; only
        sample 0 computes the prompt's log-probs, so the others can start from its cached pages."""
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        # PRNGKey takes 32 bits with x64 off: fold the high bits in so large seeds stay distinct
        key = jax.random.fold_in(jax.random.PRNGKey(seed & 0xFFFFFFFF), (seed >> 32) & 0xFFFFFFFF)
        stop = frozenset(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)))
        budget = min(params.max_tokens, self.max_model_len - len(ids))
        samples = []
        for s in range(params.best_of or params.n):
            sample_key = key if s == 0 else jax.random.fold_in(key, s)
            detokenizer = None
            if self.tokenizer is not None and (detokenize or params.stop):
                detokenizer = IncrementalDetokenizer(self.tokenizer, stop=params.stop,
                                                     include_stop_str_in_output=params.include_stop_str_in_output)
            sample_params = params if s == 0 or params.prompt_logprobs is None else \
                dataclasses.replace(params, prompt_logprobs=None)
            raw = jax.random.key_data(sample_key) if jnp.issubdtype(sample_key.dtype, jax.dtypes.prng_key) \
                else sample_key
            samples.append(Request(index, text, ids, sample_params, stop, budget, np.asarray(raw, np.uint32),
                                   detokenizer=detokenizer, sample_index=s))
        return samples
