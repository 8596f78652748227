"""``LLM(model).generate(prompts, SamplingParams(...))``: generation through the engine.

Prompts become requests of :mod:`modelopt_jax.engine`: a page pool sized from a memory budget,
continuous batching (requests are admitted while pages are free, finished ones free theirs at
once, long prompts are prefilled in chunks, and a request is preempted and later recomputed when
pages run out), sampling on the device. Shapes are bucketed so a workload compiles a handful of
programs, and JAX's persistent compilation cache keeps them across processes.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import jax

from modelopt_jax.chat_template import ChatTemplate
from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.demo import demo_checkpoint_path
from modelopt_jax.engine import Engine, EngineConfig, RequestOutput
from modelopt_jax.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, RequestTypeError
from modelopt_jax.engine.request import Request
from modelopt_jax.loader import WeightCacheOptions, load
from modelopt_jax.prompts import PromptProcessor, resolve_max_model_len
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
    ``precompile``: where the step programs form a finite table (the CUDA kernels' attention), compile
    it here (greedy and temperature sampling, no log-probs), so no ``generate`` step waits for a
    compile; JAX's persistent cache makes a later start load the programs instead.
    ``decode_steps``: forwards a decode-only step of at most a few rows runs in one launch when nothing
    waits to be admitted (``EngineConfig.decode_steps``; 1: one forward a launch). At batch 1 the host's
    cycle per launch can be longer than the GPU's step; the server streams one forward a launch.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, quantization: str | None = "modelopt",
                 dtype: str = "bfloat16", max_model_len: int | None = None, kv_cache_dtype: str = "auto",
                 backend: str = "auto", tokenizer: str | os.PathLike | None = None,
                 compilation_cache_dir: str | None = "auto", tensor_parallel_size: int = 1,
                 weight_cache: str = "off", weight_cache_dir: str | os.PathLike | None = None,
                 weight_cache_timeout: float | None = None, kv_cache_memory_fraction: float = 0.9,
                 kv_cache_bytes: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
                 enable_prefix_caching: bool = True, precompile: bool = True,
                 decode_steps: int = EngineConfig.decode_steps, **unknown: Any):
        if unknown:
            raise ArgumentTypeError(f"LLM() got unexpected keyword argument(s) {sorted(unknown)}; supported: model, "
                            f"quantization, dtype, max_model_len, kv_cache_dtype, backend, tokenizer, "
                            f"compilation_cache_dir, tensor_parallel_size, weight_cache, weight_cache_dir, "
                            f"weight_cache_timeout, kv_cache_memory_fraction, kv_cache_bytes, max_num_seqs, "
                            f"max_num_batched_tokens, enable_prefix_caching, precompile, decode_steps")
        engine_config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     enable_prefix_caching=enable_prefix_caching,
                                     precompile_samplers=EngineConfig.precompile_samplers if precompile else (),
                                     kv_cache_memory_fraction=kv_cache_memory_fraction, kv_cache_bytes=kv_cache_bytes,
                                     decode_steps=decode_steps)
        if not isinstance(precompile, bool):
            raise InvalidArgumentError(f"precompile={precompile!r} must be a bool")
        if quantization not in QUANTIZATIONS:
            raise InvalidArgumentError(f"quantization={quantization!r} not supported; use 'modelopt' or None (detect)")
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or \
                tensor_parallel_size < 1:
            raise InvalidArgumentError(f"tensor_parallel_size={tensor_parallel_size!r} must be a positive integer")
        self.path = os.fspath(model) if model is not None else demo_checkpoint_path()
        ckpt = Checkpoint.open(self.path)  # opened once: load() takes it from here
        # Arguments that only the config bounds are checked before the weights load.
        max_model_len = resolve_max_model_len(ckpt.model_config, max_model_len)
        self.max_model_len = int(max_model_len)
        # the tokenizer and chat templates are checked before the weights load
        self.prompts = PromptProcessor(self.path, ckpt.model_config, self.max_model_len, tokenizer)
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
        self.engine = Engine(self.model, max_model_len=self.max_model_len, config=engine_config,
                             pad_id=self.model.config.pad_token_id or 0)
        self.last_stats: dict[str, float] = {}

    @property
    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` in use (None: prompts must be token ids)."""
        return self.prompts.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end generation unless ``ignore_eos`` (from generation_config.json / config.json)."""
        return self.prompts.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.prompts.eos_token_ids = list(ids)

    @property
    def kv_cache_dtype(self) -> str:
        """What was asked for (``model.kv_cache`` says what it resolved to)."""
        return self.model.kv_cache.requested

    # ---- request handling -----------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids as :meth:`generate` feeds them (with ``add_special_tokens``: the
        tokenizer's own special tokens, and the BOS where the tokenizer adds none)."""
        return self.prompts.tokenize(text, add_special_tokens=add_special_tokens)

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
        """The named special tokens (``bos_token``, ``eos_token``, ...) as strings."""
        return self.prompts.special_tokens()

    def get_chat_template(self, chat_template: str | None = None) -> ChatTemplate:
        """The checkpoint's chat template (or ``chat_template``: source, a file or a name), compiled once."""
        return self.prompts.get_chat_template(chat_template)

    def chat_requests(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                      chat_template: str | None = None, add_generation_prompt: bool = True,
                      detokenize: bool = False) -> list[Request]:
        """Validated engine requests for the conversations in ``messages`` (see :meth:`chat`), not run."""
        return self.prompts.chat_requests(messages, sampling_params, chat_template=chat_template,
                                          add_generation_prompt=add_generation_prompt, detokenize=detokenize)

    def requests(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 detokenize: bool = False) -> list[Request]:
        """Validated engine requests for ``prompts`` (see :meth:`PromptProcessor.requests`), not run."""
        return self.prompts.requests(prompts, sampling_params, detokenize=detokenize)
