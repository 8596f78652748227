"""``LLM(model).generate(prompts, SamplingParams(...))``: batched, KV-cached generation.

One call runs all prompts as one batch: a prefill over the prompts (right-padded to a length
bucket, each row writing its own cache positions), then one jitted decode step per token for the
whole batch, with sampling on the device and the cache donated between steps. Shapes are
bucketed (batch and prompt length to powers of two, the cache to ``max_model_len``) so a
workload compiles a handful of programs, and JAX's persistent compilation cache keeps them across
processes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.demo import demo_checkpoint_path
from modelopt_jax.errors import ConfigError
from modelopt_jax.generation import make_cached_forward
from modelopt_jax.checkpoint.hf_config import eos_ids
from modelopt_jax.loader import WeightCacheOptions, load
from modelopt_jax.sampling import SamplingParams, sample, token_logprobs

QUANTIZATIONS = ("modelopt", None)


@dataclasses.dataclass
class RequestOutput:
    """What one prompt produced. ``logprobs[i]`` maps token id -> log-prob for generated token i
    (the chosen token and the top-k); ``prompt_logprobs[0]`` is None (nothing predicts token 0)."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


def _logprob_entry(token: int, chosen, top_values, top_ids, k: int | None) -> dict[int, float]:
    """{token: its log-prob} plus the top-``k`` alternatives (the token itself is not repeated)."""
    entry = {token: float(chosen)}
    for j in range(k or 0):
        entry.setdefault(int(top_ids[j]), float(top_values[j]))
    return entry


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


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
    (see :func:`modelopt_jax.load`).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, quantization: str | None = "modelopt",
                 dtype: str = "bfloat16", max_model_len: int | None = None, kv_cache_dtype: str = "auto",
                 backend: str = "auto", tokenizer: str | os.PathLike | None = None,
                 compilation_cache_dir: str | None = "auto", tensor_parallel_size: int = 1,
                 weight_cache: str = "off", weight_cache_dir: str | os.PathLike | None = None,
                 weight_cache_timeout: float | None = None, **unknown: Any):
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s) {sorted(unknown)}; supported: model, "
                            f"quantization, dtype, max_model_len, kv_cache_dtype, backend, tokenizer, "
                            f"compilation_cache_dir, tensor_parallel_size, weight_cache, weight_cache_dir, "
                            f"weight_cache_timeout")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={quantization!r} not supported; use 'modelopt' or None (detect)")
        self.path = os.fspath(model) if model is not None else demo_checkpoint_path()
        self.compilation_cache_dir = enable_compilation_cache(compilation_cache_dir)
        ckpt = Checkpoint.open(self.path)  # opened once: load() takes it from here
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
        cfg = self.model.config
        limit = cfg.max_position_embeddings
        self.max_model_len = int(max_model_len or min(limit, 4096))
        if not 1 < self.max_model_len <= limit:
            raise ValueError(f"max_model_len={self.max_model_len} must be in [2, {limit}] "
                             f"(the model's max_position_embeddings)")
        self.kv_cache_dtype = kv_cache_dtype
        self.tokenizer = self._load_tokenizer(tokenizer)
        self.eos_token_ids = eos_ids(self.path)
        self._forward, self._state = make_cached_forward(self.model)
        self._prefill = jax.jit(self._prefill_fn, static_argnums=(0, 1), donate_argnums=(3,))
        self._decode = jax.jit(self._decode_fn, static_argnums=(0,), donate_argnums=(2,))
        self.last_stats: dict[str, float] = {}

    def _load_tokenizer(self, tokenizer):
        path = os.fspath(tokenizer) if tokenizer is not None else os.path.join(self.path, "tokenizer.json")
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(path):
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path)

    # ---- jitted steps ---------------------------------------------------------------------------
    def _prefill_fn(self, num_logprobs, prompt_logprobs, state, cache, ids, positions, last, next_ids,
                    temps, top_k, top_p, keys):
        """Prefill all rows; sample each row's first new token from the logits at ``last``."""
        if prompt_logprobs is None:
            logits, cache = self._forward(state, ids, positions, cache, last)
            logits = logits[:, 0]
            prompt = None
        else:
            all_logits, cache = self._forward(state, ids, positions, cache)
            logits = jnp.take_along_axis(all_logits, last[:, None, None], axis=1)[:, 0]
            b, t, v = all_logits.shape
            flat = all_logits.reshape(b * t, v)
            prompt = token_logprobs(flat, next_ids.reshape(b * t), prompt_logprobs)
            prompt = jax.tree_util.tree_map(lambda a: a.reshape((b, t) + a.shape[1:]), prompt)
        tokens = sample(logits, temps, top_k, top_p, keys)
        return tokens, token_logprobs(logits, tokens, num_logprobs), prompt, cache

    def _decode_fn(self, num_logprobs, state, cache, tokens, positions, temps, top_k, top_p, keys):
        logits, cache = self._forward(state, tokens[:, None], positions[:, None], cache)
        logits = logits[:, 0]
        new = sample(logits, temps, top_k, top_p, keys)
        return new, token_logprobs(logits, new, num_logprobs), cache

    # ---- request handling -----------------------------------------------------------------------
    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.path} has no tokenizer.json: pass token-id lists instead of strings")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True).ids
            bos = self.model.config.bos_token_id
            if bos is not None and ids and ids[0] != bos:
                ids = [bos] + ids  # tokenizers that add no BOS themselves (e.g. the byte-level demo)
            return prompt, ids
        if isinstance(prompt, (list, tuple, np.ndarray)) and all(
                isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 **unknown: Any) -> list[RequestOutput]:
        """Generates for one prompt or a list (strings or token-id lists); returns one output each."""
        if unknown:
            raise TypeError(f"generate() got unexpected keyword argument(s) {sorted(unknown)}")
        # One prompt: a string or a flat sequence of ids. A 1-D numpy array counts too (``_encode``
        # accepts arrays; without this, a single array prompt was split into one-int "prompts" and
        # failed with "got int64").
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts) > 0
                                              and isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        vocab = self.model.config.vocab_size
        for i, (_, ids) in enumerate(encoded):
            if not ids:
                raise ValueError(f"prompt {i} is empty (no tokens)")
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no "
                                 f"room to generate")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        return self._run(encoded, params)

    def _run(self, encoded, params) -> list[RequestOutput]:
        n = len(encoded)
        b = _bucket(n)
        lengths = np.array([len(ids) for _, ids in encoded] + [1] * (b - n), np.int32)
        t = min(_bucket(int(lengths.max()), 16), self.max_model_len)
        pad = self.model.config.pad_token_id or 0
        ids = np.full((b, t), pad, np.int32)
        for i, (_, toks) in enumerate(encoded):
            ids[i, :len(toks)] = toks
        next_ids = np.concatenate([ids[:, 1:], np.full((b, 1), pad, np.int32)], axis=1)
        p = params + [params[0]] * (b - n)
        temps = jnp.asarray([q.temperature for q in p], jnp.float32)
        top_k = jnp.asarray([q.top_k for q in p], jnp.int32)
        top_p = jnp.asarray([q.top_p for q in p], jnp.float32)
        seeds = [q.seed if q.seed is not None else int.from_bytes(os.urandom(4), "little") for q in p]
        # PRNGKey takes 32 bits with x64 off: fold the high bits in so large seeds stay distinct
        row_keys = jnp.stack([jax.random.fold_in(jax.random.PRNGKey(s & 0xFFFFFFFF), (s >> 32) & 0xFFFFFFFF)
                              for s in seeds])
        num_logprobs = max(q.logprobs or 0 for q in params)
        want_prompt = [q.prompt_logprobs is not None for q in params]
        prompt_k = max(q.prompt_logprobs or 0 for q in params) if any(want_prompt) else None
        stop = [set(q.stop_token_ids) | (set() if q.ignore_eos else set(self.eos_token_ids)) for q in params]
        budget = [min(q.max_tokens, self.max_model_len - len(ids_)) for q, (_, ids_) in zip(params, encoded)]

        cache = self.model.init_cache(b, self.max_model_len)
        step_keys = lambda step: jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)  # noqa: E731
        t0 = time.perf_counter()
        tokens, (chosen, top_v, top_i), prompt_lp, cache = self._prefill(
            num_logprobs, prompt_k, self._state, cache, jnp.asarray(ids),
            jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), jnp.asarray(lengths - 1),
            jnp.asarray(next_ids), temps, top_k, top_p, step_keys(0))
        tokens_host = np.asarray(tokens)
        t1 = time.perf_counter()
        out_tokens = [[] for _ in range(n)]
        out_lp = [[] for _ in range(n)]
        finish = [None] * n

        def record(tok, chosen, top_v, top_i):
            chosen, top_v, top_i = np.asarray(chosen), np.asarray(top_v), np.asarray(top_i)
            for r in range(n):
                if finish[r] is not None:
                    continue
                out_tokens[r].append(int(tok[r]))
                out_lp[r].append(_logprob_entry(int(tok[r]), chosen[r], top_v[r], top_i[r], params[r].logprobs))
                if int(tok[r]) in stop[r]:
                    finish[r] = "stop"
                elif len(out_tokens[r]) >= budget[r]:
                    finish[r] = "length"

        record(tokens_host, chosen, top_v, top_i)
        step, t_first = 0, None
        while any(f is None for f in finish):
            step += 1
            positions = jnp.asarray(np.minimum(lengths + step - 1, self.max_model_len - 1))
            tokens, (chosen, top_v, top_i), cache = self._decode(
                num_logprobs, self._state, cache, tokens, positions, temps, top_k, top_p, step_keys(step))
            tokens_host = np.asarray(tokens)
            record(tokens_host, chosen, top_v, top_i)
            t_first = t_first or time.perf_counter()
        t2 = time.perf_counter()
        # the first decode step may include compilation; steady-state speed is measured after it
        steady = (step - 1) / (t2 - t_first) if step > 1 and t2 > t_first else float("nan")
        self.last_stats = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": step,
                           "first_decode_step_s": (t_first or t2) - t1, "steady_tokens_per_s": steady,
                           "generated_tokens": sum(len(o) for o in out_tokens), "batch": n,
                           "prompt_tokens": int(lengths[:n].sum())}
        prompt_np = None if prompt_lp is None else tuple(np.asarray(a) for a in prompt_lp)
        outputs = []
        for r, (text, prompt_ids) in enumerate(encoded):
            lp = out_lp[r]
            outputs.append(RequestOutput(
                prompt=text, prompt_token_ids=prompt_ids, token_ids=out_tokens[r],
                text=None if self.tokenizer is None else self.tokenizer.decode(out_tokens[r], skip_special_tokens=True),
                finish_reason=finish[r], cumulative_logprob=float(sum(e[tok] for e, tok in zip(lp, out_tokens[r]))),
                logprobs=lp if params[r].logprobs is not None else None,
                prompt_logprobs=self._prompt_logprobs(prompt_np, r, prompt_ids, params[r].prompt_logprobs)
                if want_prompt[r] else None))
        return outputs

    @staticmethod
    def _prompt_logprobs(arrays, row, prompt_ids, k):
        chosen, top_v, top_i = arrays
        result: list[dict[int, float] | None] = [None]
        for pos in range(1, len(prompt_ids)):
            result.append(_logprob_entry(prompt_ids[pos], chosen[row, pos - 1], top_v[row, pos - 1],
                                         top_i[row, pos - 1], k))
        return result
