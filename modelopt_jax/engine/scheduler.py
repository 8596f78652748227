"""Continuous batching: which requests run in the next step, and with how many tokens each.

Policy (vLLM's, simplified): a step either prefills or decodes. (Separate steps let each use its
best attention: on CUDA the decode kernel streams each token's pages once, the prefill kernel lets
a chunk's many queries share every key tile -- and elsewhere XLA lays prompt chunks out per row. On
the H200 a 2048-token prompt step took 121 ms through the per-token decode kernel, see
bench/RESULTS.md.)
- Prefill first: requests part-way through their prompt continue, then waiting requests are
  admitted in arrival order while the step's token budget (``max_prefill_tokens``) lasts, the
  running set stays under ``max_num_seqs`` and pages are free (keeping one page of headroom per
  running sequence, so admissions do not immediately force preemptions). A long prompt is split
  into chunks across steps, so one step's work stays bounded.
- A prompt step that would be short (under ``max_prefill_tokens``) while many requests decode (at
  least a quarter of ``max_num_seqs``) waits up to ``prefill_wait_steps`` decode steps for more
  admissions to join it. A busy engine frees one slot at a time as requests finish, and each lone
  admission was a prompt step of its own: on the H200 (1000 prompts, 8B) 581 prompt steps of ~940
  tokens ran at 33k tok/s where (a)'s full 2048-token steps ran at 48k (bench/RESULTS.md). Counted
  in steps, not seconds, so LLM.generate's schedule (and so its tokens) stays deterministic.
- Otherwise every running request decodes one token. A request that needs a new page when none
  is free preempts the most recently admitted request: its pages are freed at once and it goes back
  to the front of the queue, to be recomputed (prompt + what it had generated) when pages free up.
- A finished request's pages are freed the moment it finishes.
- (The server) a prompt step whose program is still compiling waits while the running requests
  decode: ``schedule(ready=...)`` plans the prompt step without changing anything, and commits it
  only once its program is ready or nothing else can run.

The engine schedules step N+1 while the device still runs step N (``speculative=True``): the
policy is the same, but such a step never preempts -- a preempted request may have a token in
flight -- so when it would have to, ``schedule`` returns None and the engine first collects step N.
"""

from __future__ import annotations

from collections import deque

from modelopt_jax.engine.pages import PagePool
from modelopt_jax.engine.request import Request


class Scheduler:
    def __init__(self, pool: PagePool, *, max_num_seqs: int, max_prefill_tokens: int, prefill_wait_steps: int = 0):
        self.pool = pool
        self.max_num_seqs = int(max_num_seqs)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.prefill_wait_steps = int(prefill_wait_steps)
        self._prefill_waited = 0  # decode steps run while a short prompt step waited for company
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0
        self.decodes_while_compiling = 0  # decode steps run while a prompt step's program compiled

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def finish(self, request: Request) -> None:
        """Takes ``request`` out of the running set and frees its pages (a no-op the second time)."""
        if request in self.running:
            self.running.remove(request)
        self.pool.release(request.pages)

    def abort(self, request: Request) -> None:
        """Removes ``request`` from the queue or the running set and frees its pages."""
        if request in self.waiting:
            self.waiting.remove(request)
        self.finish(request)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.pool.release(victim.pages)
        victim.computed = 0
        self.preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self, speculative: bool = False, ready=None) -> list[tuple[Request, int]] | None:
        """The next step's rows: (request, tokens to feed). Never empty while requests remain, unless
        ``speculative``: then None when the step would need a preemption, or has nothing to run.

        ``ready(rows) -> bool`` (optional) says whether a prompt step's program is compiled. When it
        is not and running requests can decode, they decode instead and the prompt step waits (its
        requests stay queued or part-way), so a compile does not stall every running stream.
        """
        may_wait = True
        while True:
            plan = self._plan_prefill()
            short = bool(plan) and may_wait and self._worth_waiting(plan)
            compiling = bool(plan) and not short and may_wait and ready is not None and self._can_decode() and \
                not ready([(r, n) for r, n, _ in plan])
            if plan and not (short or compiling):
                batch = self._commit_prefill(plan)
                self._prefill_waited = 0
            else:
                batch = self._decode(speculative)
                self.decodes_while_compiling += bool(compiling and batch)
                self._prefill_waited += bool(short and batch)
            if batch or speculative:
                return batch or None
            if short or compiling:  # the decode rows were all preempted: run the prompt step after all
                may_wait = False
                continue
            # Every running request is part-way through a prompt and none can get a page: free the
            # newest one's pages (one request alone always fits: the engine checks that up front).
            self._preempt(self.running[-1])

    def _can_decode(self) -> bool:
        return any(r.pending == 1 for r in self.running)

    def _worth_waiting(self, plan: list[tuple[Request, int, bool]]) -> bool:
        """Whether a prompt step of ``plan`` is short enough, and the decode batch big enough, to let
        it wait one more decode step for requests to join it (see the module docstring)."""
        if self._prefill_waited >= self.prefill_wait_steps or sum(n for _, n, _ in plan) >= self.max_prefill_tokens:
            return False
        return sum(r.pending == 1 for r in self.running) >= max(1, self.max_num_seqs // 4)

    def _plan_prefill(self) -> list[tuple[Request, int, bool]]:
        """The prompt step the policy would run now: (request, tokens, newly admitted), changing nothing."""
        plan, budget, free, admitted = [], self.max_prefill_tokens, self.pool.free, 0
        page = self.pool.page_size
        for r in [r for r in self.running if r.pending > 1]:
            n = min(r.pending, budget, (len(r.pages) + free) * page - r.computed)
            if n <= 0:
                continue
            free -= max(0, self.pool.pages_for(r.computed + n) - len(r.pages))
            plan.append((r, n, False))
            budget -= n
        for r in self.waiting:
            if budget <= 0 or len(self.running) + admitted >= self.max_num_seqs:
                break
            n = min(r.pending, budget)
            if self.pool.pages_for(n) + len(self.running) + admitted > free:
                break
            free -= self.pool.pages_for(n)
            admitted += 1
            plan.append((r, n, True))
            budget -= n
        return plan

    def _commit_prefill(self, plan: list[tuple[Request, int, bool]]) -> list[tuple[Request, int]]:
        for r, n, admitted in plan:
            if admitted:
                self.waiting.popleft()
                self.running.append(r)
            self.pool.grow(r.pages, r.computed + n)
        return [(r, n) for r, n, _ in plan]

    def _decode(self, speculative: bool = False) -> list[tuple[Request, int]] | None:
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
        return batch
