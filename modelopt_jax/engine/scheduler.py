"""Continuous batching: which requests run in the next step, and with how many tokens each.

Policy (vLLM's token budget): a step holds every running request that decodes (one token each)
plus prompt chunks up to ``max_num_batched_tokens`` tokens in all, so arriving prompts never stall
the running streams and a step's work stays bounded.
- Decodes first, in admission order. A request that needs a new page when none is free preempts the
  most recently admitted request: its pages are released (full pages stay in the prefix cache, so
  resuming is mostly a cache hit) and it goes back to the front of the queue, to be recomputed.
- Then prompt chunks: requests part-way through their prompt continue, then waiting requests are
  admitted in arrival order while the budget lasts (and a step holds no more prompt chunks than
  ``prompt_seqs_limit`` allows its tokens), the running set stays under ``max_num_seqs`` and
  pages are free beyond a *reserve*: the pages the running requests will need for their next
  ``reserve_tokens`` tokens (at most what their ``max_tokens`` leaves), so admissions rarely force a
  preemption later. A long prompt is split into chunks across steps.
- Prefix caching: an admitted request starts from the longest run of cached full pages that its
  prompt begins with (never its last token: that one is computed, to sample from), holding them
  read-only. A waiting request whose next page is being computed by another request (admitted in
  this step, or part-way through its prompt) waits for it while the requests behind it are admitted,
  so requests that share a prefix (the n samples of a prompt) compute it once.
- A finished request's pages are released the moment it finishes.
- (The server) a step whose program is still compiling runs its decodes alone, its prompt chunks
  waiting: ``schedule(ready=...)`` asks before committing them.

The engine schedules step N+1 while the device still runs step N (``speculative=True``): the
policy is the same, but such a step never preempts -- a preempted request may have a token in
flight -- so when it would have to, ``schedule`` returns None and the engine first collects step N.
"""

from __future__ import annotations

from collections import deque

from modelopt_jax.engine.buckets import MAX_PROMPT_SEQS, MIN_DECODE_ROWS, bucket, floor_token_bucket
from modelopt_jax.engine.pages import PagePool, page_keys
from modelopt_jax.engine.request import Request


class Scheduler:
    def __init__(self, pool: PagePool, *, max_num_seqs: int, max_num_batched_tokens: int, reserve_tokens: int = 0,
                 key_salt: bytes = b"", sliding_window: int | None = None, prompt_seqs_limit=None,
                 split_steps: bool = False, packed_steps: bool = False, fine_prompt_buckets: bool = False):
        self.pool = pool
        # prompt_seqs_limit(prompt tokens) -> the prompt chunks a step of that many prompt tokens may hold
        self.prompt_seqs_limit = prompt_seqs_limit or (lambda tokens: MAX_PROMPT_SEQS)
        # The runner runs a step's decodes and prompt chunks as two programs: the prompt budget is then
        # rounded down to a prompt-token bucket (its program is filled exactly), not the step's padding.
        self.split_steps = split_steps
        # The runner packs a step's decodes and prompt chunks into one program padded as one to a token
        # bucket: the prompt budget then fills the largest bucket within max_num_batched_tokens with the
        # decodes counted in, and prompt_seqs_limit is asked about the step's whole token count.
        self.packed_steps = packed_steps
        self.fine_prompt_buckets = fine_prompt_buckets  # the runner's prompt-token sizes (buckets.FINE_PROMPT_SIZES)
        self.sliding_window = sliding_window  # the model's: pages wholly before every later token's window go back
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.reserve_tokens = int(reserve_tokens)
        self.key_salt = key_salt  # roots every page key: what else, beside the tokens, decides a page's KV
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0
        self.decodes_while_compiling = 0  # steps whose prompt chunks waited for their program to compile
        self.prefix_hit_tokens = 0        # prompt tokens taken from the prefix cache at admission
        self.window_released_pages = 0    # pages given back early because they left the sliding window

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def finish(self, request: Request, keep_prefix: bool = True) -> None:
        """Takes ``request`` out of the running set and releases its pages (a no-op the second time);
        its full pages of known tokens stay in the prefix cache (a next chat turn starts with them)."""
        if request in self.running:
            self.running.remove(request)
        if keep_prefix:
            self.register_pages(request)
        self.pool.release(request.pages)

    def abort(self, request: Request) -> None:
        """Removes ``request`` from the queue or the running set and releases its pages (an aborted
        step may not have stored its keys/values: nothing more of it is offered to the cache)."""
        if request in self.waiting:
            self.waiting.remove(request)
        self.finish(request, keep_prefix=False)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.register_pages(victim)
        self.pool.release(victim.pages)
        victim.computed = 0
        victim.dropped = 0
        self.preemptions += 1
        self.waiting.appendleft(victim)

    def register_pages(self, request: Request) -> None:
        """Offers ``request``'s newly full pages to the prefix cache: those whose tokens are computed
        (their keys/values stored, or stored by a step already launched) and known on the host."""
        if not self.pool.prefix_caching:
            return
        page = self.pool.page_size
        known = len(request.prompt_ids) + len(request.generated)
        full = min(request.computed, known, len(request.pages) * page) // page
        if full <= request.registered:
            return
        keys = request.page_keys
        if len(keys) < full:
            page_keys(request.known_tokens(), page, keys, self.key_salt)
        for i in range(request.registered, full):
            if request.pages[i]:  # 0: given back before it could be offered (outside the window)
                self.pool.register(request.pages[i], keys[i])
        request.registered = full

    def schedule(self, speculative: bool = False, ready=None) -> list[tuple[Request, int]] | None:
        """The next step's rows: (request, tokens to feed), decode rows first. Never empty while
        requests remain, unless ``speculative``: then None when the step would need a preemption, or
        has nothing to run.

        ``ready(rows) -> bool`` (optional) says whether the step's program is compiled. When it is not
        and there are decodes, the decodes run alone and the prompt chunks wait (their requests stay
        queued or part-way), so a compile does not stall every running stream.
        """
        self._drop_outside_window()
        while True:
            decodes = self._decode(speculative)
            if decodes is None:
                return None
            # the decode rows as the step will pad them (one program), the prompt program's token bucket
            # (two) or the packed step's bucket: a busy step's prompt chunks then fill it exactly, and such
            # steps share a program
            base = 0  # tokens of the step that count toward the prompt section's shape beside its prompt tokens
            if self.packed_steps:
                base = len(decodes)
                budget = floor_token_bucket(self.max_num_batched_tokens, fine=self.fine_prompt_buckets) - base
            elif self.split_steps:
                budget = floor_token_bucket(self.max_num_batched_tokens - len(decodes), fine=self.fine_prompt_buckets)
            else:
                budget = self.max_num_batched_tokens - (bucket(len(decodes), MIN_DECODE_ROWS) if decodes else 0)
            plan = self._plan_prompts(budget, base)
            if plan and decodes and ready is not None and not ready(decodes + [(r, n) for r, n, _ in plan]):
                self.decodes_while_compiling += 1
                plan = []
            batch = decodes + self._commit_prompts(plan)
            if batch or speculative:
                return batch or None
            if not self.running:
                raise RuntimeError("the scheduler can run nothing: a waiting request fits no empty pool")
            # Every running request is part-way through a prompt and none can get a page: release the
            # newest one's pages (one request alone always fits: the engine checks that up front).
            self._preempt(self.running[-1])

    def decode_steps(self, batch: list[tuple[Request, int]], steps: int, max_rows: int) -> int:
        """How many forwards the step of ``batch`` runs in one launch: ``steps`` where it holds decode
        rows only (at most ``max_rows``), no request waits to be admitted (a multi-step launch would
        delay it), the model has no sliding window (pages leave it step by step) and every row has
        ``steps`` tokens of budget left (none samples past its max_tokens); then each row's pages are
        grown for those tokens. Else 1 (pages grown for some rows hold their next positions anyway)."""
        if (steps <= 1 or not batch or len(batch) > max_rows or self.waiting or self.sliding_window is not None
                or any(n != 1 or len(r.generated) + r.inflight + steps > r.budget for r, n in batch)):
            return 1
        for r, _ in batch:
            if not self.pool.grow(r.pages, r.computed + steps):
                return 1
        return steps

    def _drop_outside_window(self) -> None:
        """Gives back every running request's pages that no token from here on can attend: the next
        step's tokens sit at positions >= ``computed`` and see keys less than ``sliding_window`` back.
        Full pages are offered to the prefix cache first. A step already launched may still read such
        a page; a later step that reuses it writes after it on the same stream."""
        if self.sliding_window is None:
            return
        page = self.pool.page_size
        for r in self.running:
            first_needed = min(max(0, r.computed - self.sliding_window + 1) // page, len(r.pages))
            if first_needed <= r.dropped:
                continue
            self.register_pages(r)
            leaving = r.pages[r.dropped:first_needed]
            r.pages[r.dropped:first_needed] = [0] * len(leaving)
            r.dropped = first_needed
            self.window_released_pages += len(leaving)
            self.pool.release(leaving)

    def _decode(self, speculative: bool) -> list[tuple[Request, int]] | None:
        # Runs once or twice per step over every running request: membership is tracked in a set
        # (a list scan per row cost ~1 ms a step at 256 rows, bench/host_loop.py).
        batch, preempted = [], set()
        for r in list(self.running):
            if r in preempted or r.pending != 1:
                continue
            if not self.pool.grow(r.pages, r.computed + 1):
                if speculative:
                    return None  # (pages already grown for earlier rows hold their next positions anyway)
                # preempt from the newest: rows not visited yet, or r itself
                while not self.pool.grow(r.pages, r.computed + 1):
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.add(victim)
                    if victim is r:
                        break
                if r in preempted:
                    continue
            batch.append((r, 1))
        return [row for row in batch if row[0] not in preempted]

    def _reserve(self) -> int:
        """Pages held back from admissions for the running requests' next ``reserve_tokens`` tokens."""
        if not self.reserve_tokens:
            return 0
        page, total = self.pool.page_size, 0
        for r in self.running:
            end = len(r.prompt_ids) + min(r.budget, len(r.generated) + r.inflight + self.reserve_tokens)
            total += max(0, -(-end // page) - len(r.pages))
        return total

    def _plan_prompts(self, budget: int, base: int = 0) -> list[tuple[Request, int, list[int]]]:
        """The prompt chunks that fit ``budget`` tokens now: (request, tokens, cached pages it starts
        from -- newly admitted requests only), changing nothing. ``base``: the step's other tokens
        that share the prompt section's shape (a packed step's decodes)."""
        plan, free, admitted, planned = [], self.pool.free, 0, base
        page = self.pool.page_size
        prefilling = []  # requests whose prompt pages are still to be computed, with the first such page
        for r in self.running:
            if r.pending > 1 and r.computed < len(r.prompt_ids):
                prefilling.append(r)
            if r.pending <= 1 or budget <= 0:
                continue
            n = min(r.pending, budget, (len(r.pages) + free) * page - r.computed)
            if n <= 0 or len(plan) >= self.prompt_seqs_limit(planned + n):
                continue
            free -= max(0, self.pool.pages_for(r.computed + n) - len(r.pages))
            plan.append((r, n, []))
            budget -= n
            planned += n
        reserve = self._reserve() if self.waiting and budget > 0 else 0
        computing = None  # keys of prompt pages some request computes now (built on first need)
        for r in self.waiting:
            if budget <= 0 or len(self.running) + admitted >= self.max_num_seqs:
                break
            shared = self._cached_prefix(r)
            if computing is None:
                computing = self._pages_being_computed(prefilling)
            if self._waits_for_prefix(r, len(shared), computing):
                continue  # its next page is being computed: it joins a later step and shares it
            start = len(shared) * page
            n = min(r.pending - start, budget)
            if len(plan) >= self.prompt_seqs_limit(planned + n):
                break
            need = self.pool.pages_for(start + n) - len(shared)
            # cached pages nobody holds count as free: taking them makes them unavailable
            idle_shared = sum(self.pool.refcount(p) == 0 for p in shared)
            if need + idle_shared + reserve > free:
                break
            free -= need + idle_shared
            reserve += self._reserve_of(r)
            admitted += 1
            plan.append((r, n, shared))
            self._note_computing(r, start, computing)
            budget -= n
            planned += n
        return plan

    def _reserve_of(self, r: Request) -> int:
        if not self.reserve_tokens:
            return 0
        end = len(r.prompt_ids) + min(r.budget, len(r.generated) + self.reserve_tokens)
        return max(0, self.pool.pages_for(end) - self.pool.pages_for(len(r.prompt_ids) + len(r.generated)))

    def _cached_prefix(self, r: Request) -> list[int]:
        """The cached pages ``r``'s known tokens start with, short of its last token (computed to sample
        from); none for a request that wants prompt log-probs (they come from computing the prompt)."""
        if not self.pool.prefix_caching or r.params.prompt_logprobs is not None:
            return []
        tokens = r.known_tokens()
        usable = (len(tokens) - 1) // self.pool.page_size
        if len(r.page_keys) < usable:
            page_keys(tokens, self.pool.page_size, r.page_keys, self.key_salt)
        return self.pool.lookup(r.page_keys[:usable])

    def _pages_being_computed(self, prefilling: list[Request]) -> set[bytes]:
        """Keys of the full prompt pages that requests part-way through their prompts have not
        registered yet (they are computing them, in this step or a later one)."""
        keys: set[bytes] = set()
        if not self.pool.prefix_caching:
            return keys
        for r in prefilling:
            self._note_computing(r, r.registered * self.pool.page_size, keys)
        return keys

    def _note_computing(self, r: Request, start: int, keys: set[bytes]) -> None:
        """Adds the keys of ``r``'s full prompt pages from position ``start`` on to ``keys``."""
        if not self.pool.prefix_caching or r.params.prompt_logprobs is not None:
            return
        page = self.pool.page_size
        full = len(r.prompt_ids) // page
        if len(r.page_keys) < full:
            page_keys(r.prompt_ids, page, r.page_keys, self.key_salt)
        keys.update(r.page_keys[start // page:full])

    def _waits_for_prefix(self, r: Request, hit_pages: int, computing: set[bytes]) -> bool:
        """Whether ``r``'s first page not in the cache is one another request is computing: then it
        waits for that page rather than computing it a second time (the n samples of a prompt,
        requests that share a system prompt and arrive together)."""
        if not computing or r.params.prompt_logprobs is not None:
            return False
        return hit_pages < len(r.page_keys) and r.page_keys[hit_pages] in computing

    def _commit_prompts(self, plan: list[tuple[Request, int, list[int]]]) -> list[tuple[Request, int]]:
        # Admissions first take their cached prefix pages, then every row grows: a fresh page may
        # evict the least recently released cached page, which must not be one the plan starts from.
        for r, n, shared in plan:
            if r in self.running:
                continue
            if self.waiting[0] is r:  # admissions keep arrival order, but for requests waiting on a prefix
                self.waiting.popleft()
            else:
                self.waiting.remove(r)
            self.running.append(r)
            self.pool.share(r.pages, shared)
            r.computed = len(shared) * self.pool.page_size
            r.registered = len(shared)
            r.cached_tokens = r.computed
            self.prefix_hit_tokens += r.computed
        batch = []
        for r, n, _ in plan:
            if not self.pool.grow(r.pages, r.computed + n):
                raise RuntimeError("the scheduler planned more pages than the pool has")
            batch.append((r, n))
        return batch
