"""Which pages of the pool are free, which sequences hold, and which keep a reusable prefix.

Page 0 is never handed out: it is the scratch page that padding tokens write to (see
:class:`modelopt_jax.kv_cache.PagedKVCache`). A sequence holds the pages for its first
``len(pages) * page_size`` positions, in order; its block table is that list. A sliding-window
model's sequence gives back the leading pages no later token can see; their entries become 0
(held by nobody, skipped by :meth:`PagePool.release`).

Automatic prefix caching: a *full* page whose tokens are known is registered under a key that
chains the key of the page before it with its own token ids (:func:`page_keys`), so equal keys mean
equal token prefixes and so equal keys/values. Keys are SHA-256 digests: a prompt crafted to collide
with another user's prefix would read that user's keys and values, which a 64-bit hash of the
tokens would allow. A registered page is shared read-only by every sequence whose tokens start
with the same prefix (reference-counted); when no sequence holds it any more it stays cached, and
pages are evicted least recently released first only when a fresh page is needed and the free list
is empty. A page with no key (a partial last page, a duplicate) goes back to the free list at once.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np


def page_keys(tokens: Sequence[int], page_size: int, keys: list[bytes], salt: bytes = b"") -> list[bytes]:
    """Extends ``keys`` (in place) with the keys of the next full pages of ``tokens``: key i is
    SHA-256(key i-1 or ``salt``, the page's token ids). Returns ``keys``."""
    full = len(tokens) // page_size
    previous = keys[-1] if keys else salt
    for i in range(len(keys), full):
        page = np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64).tobytes()
        previous = hashlib.sha256(previous + page).digest()
        keys.append(previous)
    return keys


class PagePool:
    """Pages 1..num_pages-1: each is free, held (reference count > 0), or cached (count 0, keyed,
    evictable). Allocation and release are O(pages)."""

    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.prefix_caching = bool(prefix_caching)
        self._free = list(range(self.num_pages - 1, 0, -1))  # unkeyed pages nobody holds; pop() gives low ids first
        self._refs = [0] * self.num_pages                    # sequences holding each page
        self._key_of: list[bytes | None] = [None] * self.num_pages
        self._page_of: dict[bytes, int] = {}                 # key -> the page registered under it
        self._cached: OrderedDict[int, None] = OrderedDict()  # keyed pages nobody holds, least recently released first
        self.evictions = 0

    @property
    def free(self) -> int:
        """Pages a sequence can get now (free ones, plus cached ones that would be evicted)."""
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        """Keyed pages that no sequence holds (kept for reuse, evictable)."""
        return len(self._cached)

    @property
    def held(self) -> int:
        """Pages some sequence holds."""
        return self.num_pages - 1 - self.free

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._cached.popitem(last=False)  # the least recently released
            del self._page_of[self._key_of[page]]
            self._key_of[page] = None
            self.evictions += 1
        self._refs[page] = 1
        return page

    def grow(self, pages: list[int], tokens: int) -> bool:
        """Extends ``pages`` (in place) with fresh pages to hold ``tokens`` positions; False (and no
        change) if the pool is short."""
        need = self.pages_for(tokens) - len(pages)
        if need <= 0:
            return True
        if need > self.free:
            return False
        pages.extend(self._take() for _ in range(need))
        return True

    def release(self, pages: list[int]) -> None:
        """Drops the holder's reference to each of ``pages`` and empties the list. The last page is
        released first, so a sequence's deepest (least shared) pages are evicted before its first."""
        for page in reversed(pages):
            if page == 0:  # a page given back early (outside a sliding window): not held
                continue
            refs = self._refs[page] - 1
            if refs < 0:
                raise RuntimeError(f"page {page} released more often than it was taken")
            self._refs[page] = refs
            if refs == 0:
                if self._key_of[page] is not None:
                    self._cached[page] = None
                else:
                    self._free.append(page)
        pages.clear()

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages registered under the longest prefix of ``keys`` (nothing is taken)."""
        found = []
        if self.prefix_caching:
            for key in keys:
                page = self._page_of.get(key)
                if page is None:
                    break
                found.append(page)
        return found

    def share(self, pages: list[int], shared: Sequence[int]) -> None:
        """Appends registered ``shared`` pages (from :meth:`lookup`) to ``pages``, taking a reference each."""
        for page in shared:
            if self._key_of[page] is None:
                raise RuntimeError(f"page {page} is not a cached prefix page")
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1
            pages.append(page)

    def register(self, page: int, key: bytes) -> None:
        """Records that held ``page`` is full and holds the prefix ``key`` names. A key already
        registered keeps its page (this one stays unkeyed and is freed when released)."""
        if not self.prefix_caching or self._key_of[page] is not None or key in self._page_of:
            return
        if self._refs[page] < 1:
            raise RuntimeError(f"page {page} registered while no sequence holds it")
        self._key_of[page] = key
        self._page_of[key] = page

    def check(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent (tests)."""
        assert all(r >= 0 for r in self._refs), "negative reference count"
        free, cached = set(self._free), set(self._cached)
        assert not free & cached and len(free) == len(self._free), "a page is both free and cached"
        for page in range(1, self.num_pages):
            holders = self._refs[page]
            assert (page in free) + (page in cached) + (holders > 0) == 1, f"page {page} is in no state or two"
            assert (page in cached) <= (self._key_of[page] is not None), f"cached page {page} has no key"
            assert (page in free) <= (self._key_of[page] is None), f"free page {page} keeps a key"
        assert all(self._page_of[self._key_of[p]] == p for p in range(self.num_pages) if self._key_of[p] is not None)
