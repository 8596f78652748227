"""``Engine``: requests in, outputs out, through a page pool sized from a memory budget.

Two ways in: :meth:`Engine.run` takes a list and returns its outputs (``LLM.generate``);
:meth:`Engine.add` / :meth:`Engine.step` / :meth:`Engine.abort` let a caller (a server's engine
thread) add requests while others run and see each token as it is sampled.

The loop: the scheduler picks the next step's rows, the runner runs it on the device and copies
back the sampled tokens (one transfer), the host records them, frees the pages of finished
requests and goes again until every request is done. Outputs come back in request order.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax

from modelopt_jax.engine.pages import PagePool
from modelopt_jax.engine.request import Request, RequestOutput, group_outputs, logprob_entry
from modelopt_jax.engine.runner import Runner
from modelopt_jax.engine.scheduler import Scheduler
from modelopt_jax.engine.step_programs import MULTI_STEP_ROWS
from modelopt_jax.errors import ConfigError
from modelopt_jax.ops.paged_step import AttentionConfig
from modelopt_jax.sampling import SAMPLERS


MAX_PROMPT_DEFER_S = 30.0  # longest a prompt step waits for its off-thread compile before compiling in line
CPU_DEFAULT_SEQS = 8  # full-length sequences the default CPU pool holds (see pool_bytes)
# max_num_seqs=None: LARGE_POOL_SEQS rows where the pool holds that many sequences of
# LARGE_POOL_TOKENS tokens, else SMALL_POOL_SEQS. Why: more rows finish a workload in fewer,
# fuller decode steps -- on the H200 (8B FP8, 1000 prompts of 64-1024 tokens, 32-512 new) 256
# rows gave 11,702 generated tok/s, 512 rows 12,343 and 1024 rows 11,995; on an H100 80GB (a pool
# of 454k tokens) 256 rows 9,385 and 512 rows 10,607 with no preemption (bench/RESULTS.md). Rows
# are only taken where the admission reserve (reserve_tokens) finds pages for them, so a pool
# that holds fewer long sequences admits fewer; the threshold only keeps small pools (the CPU's)
# from compiling decode programs for rows they can never fill.
LARGE_POOL_SEQS, LARGE_POOL_TOKENS, SMALL_POOL_SEQS = 512, 512, 256


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine uses memory and batches work (vLLM's names where they exist)."""

    page_size: int = 16                       # tokens per KV page
    max_num_seqs: int | None = None           # running requests at most (decode rows of a step); None:
                                              # by the pool's size (see default_max_num_seqs)
    max_num_batched_tokens: int = 8192        # tokens per step at most: its decodes plus prompt chunks
    enable_prefix_caching: bool = True        # reuse cached full pages of equal prompt prefixes
    reserve_tokens: int = 1024                # admissions leave pages for the running requests' next
                                              # reserve_tokens tokens (at most their max_tokens); 0: none
    kv_cache_memory_fraction: float = 0.9     # GPU: share of device memory the weights + pool may use
    kv_cache_bytes: int | None = None         # or an explicit pool size in bytes (any platform)
    split_steps: bool = True                  # a step with decodes and prompt chunks runs as two programs, so
                                              # the programs are decode buckets + prompt buckets (Runner)
    precompile_samplers: tuple[str, ...] = ("greedy", "tempered")  # where the step programs form a table (the
                                              # CUDA kernels' paths), compile it at start-up for these samplers
                                              # (sampling.SAMPLERS); (): compile each program on first use
    packed_steps: bool = False                # a step with prompt chunks runs as one program, its decodes and
                                              # prompt tokens packed side by side and padded as one to a token
                                              # bucket (ops.paged_step's packed layout): the weights read once per
                                              # mixed step, one program per token bucket (split_steps then applies
                                              # to nothing). Off until measured beside split steps on a GPU
    fine_prompt_buckets: bool = True          # a step's prompt tokens pad to powers of two and also to 384, 768
                                              # and 1536 (buckets.FINE_PROMPT_SIZES): less padded prompt work for
                                              # one arriving prompt, three more programs per sampler to compile
    decode_steps: int = 4                     # > 1: decode-only steps of at most step_programs.MULTI_STEP_ROWS
                                              # rows, with nothing waiting to be admitted, run this many forwards in
                                              # one launch
                                              # (the host's cycle paid once per that many tokens; tokens a row
                                              # samples after its stop are dropped). 4: batch-1 MoE decode where
                                              # the host's cycle exceeds the GPU's step ran 1.4-1.6x faster per token,
                                              # a GPU-bound dense 8B the same (H100, bench/RESULTS.md 2026-12-07)

    def __post_init__(self):
        if not (isinstance(self.kv_cache_memory_fraction, (int, float)) and 0 < self.kv_cache_memory_fraction <= 1):
            raise ConfigError(f"kv_cache_memory_fraction={self.kv_cache_memory_fraction!r} must be in (0, 1]")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if name == "max_num_seqs" and value is None:  # the engine picks it for its pool
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer" +
                                  (" or None" if name == "max_num_seqs" else ""))
        value = self.reserve_tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"reserve_tokens={value!r} must be a non-negative integer")
        if not isinstance(self.decode_steps, int) or isinstance(self.decode_steps, bool) or not 1 <= self.decode_steps <= 64:
            raise ConfigError(f"decode_steps={self.decode_steps!r} must be an integer from 1 to 64")
        if not isinstance(self.fine_prompt_buckets, bool):
            raise ConfigError(f"fine_prompt_buckets={self.fine_prompt_buckets!r} must be a bool")
        if not isinstance(self.split_steps, bool):
            raise ConfigError(f"split_steps={self.split_steps!r} must be a bool")
        if not isinstance(self.packed_steps, bool):
            raise ConfigError(f"packed_steps={self.packed_steps!r} must be a bool")
        if not isinstance(self.precompile_samplers, tuple) or any(s not in SAMPLERS for s in self.precompile_samplers):
            raise ConfigError(f"precompile_samplers={self.precompile_samplers!r} must be a tuple of "
                              f"{', '.join(map(repr, SAMPLERS))}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a bool")
        if self.kv_cache_bytes is not None and (not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes <= 0):
            raise ConfigError(f"kv_cache_bytes={self.kv_cache_bytes!r} must be a positive integer or None")


def _first_device(model):
    """The device the model's arrays (and so the pool) live on: the mesh's first, or the default one."""
    return model.mesh.devices.flat[0] if model.mesh is not None else jax.local_devices()[0]


def pool_bytes(model, config: EngineConfig, max_model_len: int) -> int:
    """The pool's byte budget: explicit, or what the device has left under the memory fraction.

    GPU: ``fraction * bytes_limit - bytes_in_use`` (the weights and compiled programs are already
    there) minus a reserve for a step's activations (5% of the device, at least 1 GiB). Elsewhere
    (no allocator statistics, i.e. the CPU): room for ``CPU_DEFAULT_SEQS`` sequences of
    ``max_model_len`` tokens, capped at ``fraction`` of a quarter of the host's memory -- small,
    because XLA:CPU copies a layer's whole pool on every cache write (a 1 GB pool cost 0.7 s per
    decode step of the demo model; 20 MB, 6 ms).
    """
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    device = _first_device(model)
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        limit, used = stats["bytes_limit"], stats.get("bytes_in_use", 0)
        reserve = max(1 << 30, limit // 20)
        per_device = int(config.kv_cache_memory_fraction * limit) - used - reserve
        return max(0, per_device) * model.tensor_parallel_size
    want = model.kv_cache.page_bytes(config.page_size) * (-(-max_model_len // config.page_size)) * \
        min(config.max_num_seqs or CPU_DEFAULT_SEQS, CPU_DEFAULT_SEQS)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(want, int(config.kv_cache_memory_fraction * host / 4))


def check_attention(model, attention: AttentionConfig) -> None:
    """Refuses, before any step runs, an ``attention`` given by hand that the model's devices cannot
    run: on a GPU the CUDA kernels serve only the geometries and pool dtypes that
    ``model.attention_config`` resolves them for (a float32 pool, say), and a step would otherwise fail
    inside the compiled program with the handler's error. Elsewhere the kernels' CPU handlers serve
    every pool dtype (tests compare layouts through them), so only the window is checked there."""
    if attention.sliding_window != model.config.sliding_window:
        raise ConfigError(f"attention.sliding_window={attention.sliding_window} differs from the model's "
                          f"sliding_window={model.config.sliding_window}")
    if _first_device(model).platform != "gpu":
        return
    chosen = {f.name: getattr(attention, f.name) for f in dataclasses.fields(attention)
              if f.name not in ("page_size", "sliding_window")}
    try:
        model.attention_config(attention.page_size, **chosen)
    except ValueError as e:
        raise ConfigError(f"attention={attention}: {e}") from None


def default_max_num_seqs(pool_pages: int, page_size: int) -> int:
    """The rows a decode step may take when ``max_num_seqs`` is not given: LARGE_POOL_SEQS where a
    pool of ``pool_pages`` holds that many LARGE_POOL_TOKENS-token sequences, else SMALL_POOL_SEQS."""
    large = pool_pages * page_size >= LARGE_POOL_SEQS * LARGE_POOL_TOKENS
    return LARGE_POOL_SEQS if large else SMALL_POOL_SEQS


class Engine:
    """Continuous batching over a paged KV cache for one model."""

    def __init__(self, model, *, max_model_len: int, config: EngineConfig = EngineConfig(), pad_id: int = 0,
                 attention: AttentionConfig | None = None):
        """``attention``: the attention paths (default: the fastest the model's devices run, see
        ``model.attention_config``); A/B runs pass another."""
        self.max_model_len = int(max_model_len)
        page_bytes = model.kv_cache.page_bytes(config.page_size)
        budget = pool_bytes(model, config, self.max_model_len)
        budget_pages = budget // page_bytes
        pages_per_seq = -(-self.max_model_len // config.page_size)
        if config.max_num_seqs is None:  # resolved once; self.config says what runs
            config = dataclasses.replace(config, max_num_seqs=default_max_num_seqs(budget_pages, config.page_size))
        self.model, self.config = model, config
        # Never more than max_num_seqs full-length sequences can use (plus scratch): the rest of the
        # budget stays free for other work in the process.
        num_pages = min(budget_pages, config.max_num_seqs * pages_per_seq + 1)
        need = pages_per_seq + 1  # one full-length sequence, plus scratch
        if num_pages < need:
            raise ConfigError(
                f"the KV-cache budget ({budget / 2**20:.1f} MiB) holds {max(num_pages - 1, 0)} pages of "
                f"{config.page_size} tokens, fewer than one sequence of max_model_len={self.max_model_len} "
                f"needs ({need - 1} pages, {(need - 1) * page_bytes / 2**20:.1f} MiB); "
                f"raise kv_cache_memory_fraction / kv_cache_bytes or lower max_model_len")
        if attention is None:
            attention = model.attention_config(config.page_size)
        else:
            check_attention(model, attention)
        if attention.page_size != config.page_size:
            raise ConfigError(f"attention.page_size={attention.page_size} differs from the engine's page_size="
                              f"{config.page_size}")
        self.attention = attention
        self.pool = PagePool(num_pages, config.page_size, prefix_caching=config.enable_prefix_caching)
        self.runner = Runner(model, num_pages, attention, pad_id, fixed_table_width=pages_per_seq,
                             max_rows=config.max_num_seqs, split_steps=config.split_steps,
                             packed_steps=config.packed_steps,
                             decode_steps=config.decode_steps, fine_prompt_buckets=config.fine_prompt_buckets)
        self.overlap = True  # launch step N+1 before collecting step N (see step)
        # True (the server): a step whose program is not compiled yet runs its decodes alone while
        # it compiles off-thread (Runner.ready; at most MAX_PROMPT_DEFER_S, then in line). Off for
        # Engine.run (LLM.generate): which steps wait would then depend on compile times, and so
        # would batch compositions and, through bf16/FP8 near-ties, tokens; a script run twice
        # must give the same text.
        self.compile_in_background = False
        # False (the server): one forward a launch whatever config.decode_steps says, so a streaming
        # client gets each token as its forward ends rather than a launch's tokens at once.
        self.multi_step = True
        self._deferred_since: float | None = None
        self._inflight = None
        # A page's keys/values depend on its tokens and on what the cache stores them as.
        salt = repr((model.kv_cache.layers, config.page_size)).encode()
        self._scheduler = Scheduler(self.pool, max_num_seqs=config.max_num_seqs,
                                    max_num_batched_tokens=config.max_num_batched_tokens,
                                    reserve_tokens=config.reserve_tokens, key_salt=salt,
                                    sliding_window=model.config.sliding_window,
                                    prompt_seqs_limit=self.runner.prompt_seqs_limit, split_steps=config.split_steps,
                                    packed_steps=config.packed_steps, fine_prompt_buckets=config.fine_prompt_buckets)
        self.precompiled, self.precompile_seconds = 0, 0.0
        if config.precompile_samplers and self.runner.has_program_table:
            self.precompile(config.precompile_samplers)
        self._reset_stats()
        self.last_stats: dict[str, float] = {}

    def precompile(self, samplers=("greedy",), workers: int | None = None) -> int:
        """Compiles every step program this engine's steps can run with ``samplers`` and no log-probs
        (:meth:`Runner.program_table`), so that no step waits for a compile: a program is a
        whole-model compile, and a first run that meets a score of them spends most of its time
        compiling (bench/RESULTS.md). ``workers`` compiles run at once (default: half the CPUs, at
        most 8; JAX's persistent cache makes a later start load them instead). Returns how many
        were compiled. Only where the programs form a table (``runner.has_program_table``)."""
        if workers is None:
            workers = max(1, min(8, (os.cpu_count() or 2) // 2))
        t0 = time.perf_counter()
        done = self.runner.precompile(self.runner.program_table(self.config.max_num_batched_tokens, samplers), workers)
        self.precompiled += done
        self.precompile_seconds += time.perf_counter() - t0
        return done

    # -- step-wise use (a server's loop): add requests any time, step until idle ------------------

    def add(self, request: Request) -> None:
        """Queues ``request``; it joins the running batch in a later :meth:`step`."""
        self._scheduler.add(request)

    def abort(self, request: Request) -> None:
        """Drops ``request`` wherever it is (queued or running) and frees its pages at once."""
        self._scheduler.abort(request)
        if request.finish_reason is None:
            request.finish_reason = "abort"

    def gauges(self) -> dict[str, int | float]:
        """What a server reports of the engine now: requests running and waiting, the fraction of
        KV pages held (cached pages nobody holds count as free), and totals since start."""
        return {"running": len(self._scheduler.running), "waiting": len(self._scheduler.waiting),
                "kv_cache_usage": self.pool.held / max(self.pool.num_pages - 1, 1),
                "prefix_cache_hit_tokens": self._scheduler.prefix_hit_tokens,
                "preemptions": self._scheduler.preemptions, "programs": len(self.runner.shapes),
                "decodes_while_compiling": self._scheduler.decodes_while_compiling}

    def counters(self) -> dict[str, int | float]:
        """Step counts and times since the last ``generate`` began (since start in a server, which
        only steps), for a server's periodic log: a caller takes differences between two calls.
        ``prefill_s`` / ``decode_s`` are the wall time of steps with / without prompt chunks."""
        stats = self._stats
        return {"steps": stats["steps"], "prefill_steps": stats["prefill_steps"], "mixed_steps": stats["mixed_steps"],
                "prefill_s": stats["prefill_s"], "decode_s": stats["decode_s"],
                "prefill_tokens_computed": stats["prefill_tokens_computed"],
                "shared_prefix_rows": self.runner.shared_prefix_rows, "inline_compiles": self.runner.inline_compiles}

    @property
    def has_work(self) -> bool:
        return not self._scheduler.done or self._inflight is not None

    def step(self) -> list[Request]:
        """Advances generation by one step; returns the requests that received a token in it
        (finished ones included: their ``finish_reason`` is set and their pages are already free).

        Overlapped: it launches the next step before copying back the current one whenever the
        scheduler can decide that step without the current one's tokens (the device reads them
        itself), so the device never waits for the host's bookkeeping. Where it cannot (a step
        that would preempt), it collects first and schedules then, as a plain loop would.
        """
        if not self.has_work:
            return []
        t0 = time.perf_counter()
        try:
            ready = self._prompt_step_ready if self.compile_in_background else None
            if self._inflight is None:
                batch = self._scheduler.schedule(ready=ready)
                self._inflight = self._launch(batch)
            current = self._inflight
            following = self._scheduler.schedule(speculative=True, ready=ready) if self.overlap else None
            self._inflight = self._launch(following) if following else None
            self._stats["overlapped_steps"] += following is not None
            advanced = self._collect(current)
        except BaseException:
            # A failed step (a device error, out of memory) leaves its requests' state undefined:
            # nothing stays in flight, and the caller aborts them (which frees their pages).
            self._inflight = None
            raise
        stats = self._stats
        stats["steps"] += current.steps
        stats["multi_step_launches"] += current.steps > 1
        stats["prefill_steps"] += current.is_prompt
        stats["mixed_steps"] += current.is_mixed
        stats["prefill_s" if current.is_prompt else "decode_s"] += time.perf_counter() - t0
        return advanced

    def _prompt_step_ready(self, batch: list[tuple[Request, int]]) -> bool:
        """The scheduler's question before a step with prompt chunks: may it run now (True), or should
        the running requests decode alone while its program compiles (False)?"""
        if self.runner.ready(batch):
            return True
        now = time.perf_counter()
        if self._deferred_since is None:
            self._deferred_since = now
        # past the bound (arrivals keep changing its shape), it runs and compiles in line
        return now - self._deferred_since > MAX_PROMPT_DEFER_S

    def _launch(self, batch: list[tuple[Request, int]]):
        """Dispatches ``batch`` (as several forwards where the scheduler allows, see
        ``EngineConfig.decode_steps``) and advances its requests as if it had run: their fed tokens
        count as computed, a row that samples has one more token in flight per forward, and a request
        whose budget those tokens complete leaves the running set now (its pages can serve the next
        step: the device runs steps in order)."""
        self._stats["max_running"] = max(self._stats["max_running"], len(self._scheduler.running))
        steps = self._scheduler.decode_steps(batch, self.config.decode_steps if self.multi_step else 1,
                                             MULTI_STEP_ROWS)
        launched = self.runner.launch(batch, steps)
        if launched.is_prompt:
            self._deferred_since = None  # a prompt step runs: any wait for a compile is over
        scheduler = self._scheduler
        for r, n, start, samples, row in launched.rows:
            n *= launched.steps  # a multi-step launch feeds each (decode) row steps tokens
            r.computed += n
            if start < len(r.prompt_ids):
                self._stats["prefill_tokens_computed"] += min(n, len(r.prompt_ids) - start)
            if n > 1 or start < len(r.prompt_ids):
                scheduler.register_pages(r)  # its new full pages serve later steps (the device runs in order)
            if samples:
                r.inflight += launched.steps
                r.inflight_row = row
                if r.sampled_all:
                    scheduler.finish(r)
        return launched

    def _collect(self, launched) -> list[Request]:
        result = self.runner.collect(launched)
        sampled, sampled_logprob = result.tokens.tolist(), result.chosen.tolist()  # Python ints and floats, once
        advanced = []
        for r, n, start, samples, row in launched.rows:
            if r.finish_reason is not None:  # stopped in the step before, or aborted: nothing more to record
                continue
            if result.prompt is not None and r.params.prompt_logprobs is not None:
                chosen, top_v, top_i = result.prompt[row]
                for t in range(n):
                    p = start + t + 1
                    if p < len(r.prompt_ids):
                        r.prompt_logprobs[p] = logprob_entry(r.prompt_ids[p], chosen[t], top_v[t], top_i[t],
                                                             r.params.prompt_logprobs)
            if not samples:
                continue
            advanced.append(r)
            for j in range(launched.steps):  # a multi-step launch's tokens in order, up to the row's stop
                r.accept(sampled[j][row], sampled_logprob[j][row], result.top_values[j, row], result.top_ids[j, row])
                if r.finish_reason is not None:  # a later token of this launch is dropped
                    self._scheduler.finish(r)
                    break
        return advanced

    # -- batch use (LLM.generate) ---------------------------------------------------------------

    def run(self, requests: list[Request], *, tokenizer=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generates for ``requests`` (alone: the engine must be idle) and returns their outputs in order."""
        if self.has_work:
            raise RuntimeError("Engine.run needs an idle engine; it is serving step-wise requests")
        self._reset_stats()
        for r in requests:
            self.add(r)
        progress = _progress(len(requests), use_tqdm)
        t0 = time.perf_counter()
        first_token_s = None
        try:
            while self.has_work:
                for r in self.step():
                    first_token_s = first_token_s or time.perf_counter() - t0
                    if r.finish_reason is not None:
                        progress(1)
        except BaseException:  # an interrupted run (KeyboardInterrupt, a device error) leaves no pages taken
            for r in requests:
                self.abort(r)
            raise
        finally:
            progress(None)
        total = time.perf_counter() - t0
        generated = sum(len(r.generated) for r in requests)
        stats = self._stats
        self.last_stats = {**stats, "decode_steps": stats["steps"] - stats["prefill_steps"], "total_s": total,
                           "first_token_s": first_token_s or total, "generated_tokens": generated,
                           "generated_tokens_per_s": generated / total if total else float("nan"),
                           "prompt_tokens": sum(len(r.prompt_ids) for r in requests), "batch": len(requests),
                           "preemptions": self._scheduler.preemptions - self._preemptions_before,
                           "decodes_while_compiling": (self._scheduler.decodes_while_compiling
                                                       - self._decodes_while_compiling_before),
                           "prefix_cache_hit_tokens": self._scheduler.prefix_hit_tokens - self._hits_before,
                           "prefix_cache_evictions": self.pool.evictions - self._evictions_before,
                           "window_released_pages": (self._scheduler.window_released_pages
                                                     - self._window_released_before),
                           "programs": len(self.runner.shapes),
                           "inline_compiles": self.runner.inline_compiles - self._inline_compiles_before,
                           "shared_prefix_rows": self.runner.shared_prefix_rows - self._shared_prefix_rows_before,
                           "num_pages": self.pool.num_pages,
                           "free_pages_after": self.pool.free, "cached_pages_after": self.pool.cached}
        return group_outputs(requests, tokenizer)

    def _reset_stats(self) -> None:
        self._stats = {"steps": 0, "prefill_steps": 0, "mixed_steps": 0, "overlapped_steps": 0, "multi_step_launches": 0,
                       "prefill_s": 0.0,
                       "decode_s": 0.0, "max_running": 0, "prefill_tokens_computed": 0}
        # the scheduler counts over the engine's life
        self._preemptions_before = self._scheduler.preemptions
        self._decodes_while_compiling_before = self._scheduler.decodes_while_compiling
        self._hits_before = self._scheduler.prefix_hit_tokens
        self._evictions_before = self.pool.evictions
        self._window_released_before = self._scheduler.window_released_pages
        self._inline_compiles_before = self.runner.inline_compiles
        self._shared_prefix_rows_before = self.runner.shared_prefix_rows


def _progress(total: int, enabled: bool):
    """``update(n)`` for a tqdm bar over finished requests (``update(None)`` closes it); a no-op when
    disabled or when tqdm is not installed."""
    if not enabled:
        return lambda n: None
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda n: None
    bar = tqdm(total=total, desc="generate", unit="req", file=sys.stderr, dynamic_ncols=True)
    return lambda n: bar.close() if n is None else bar.update(n)
