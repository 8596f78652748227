"""Which pages of the pool are free and which a sequence owns (host-side bookkeeping only).

Page 0 is never handed out: it is the scratch page that padding tokens write to (see
:class:`modelopt_jax.kv_cache.PagedKVCache`). A sequence holds the pages for its first
``len(pages) * page_size`` positions, in order; its block table is that list.
"""

from __future__ import annotations


class PagePool:
    """A free list of page ids 1..num_pages-1; allocation and release are O(pages)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self._free = list(range(self.num_pages - 1, 0, -1))  # pop() hands out low ids first

    @property
    def free(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def grow(self, pages: list[int], tokens: int) -> bool:
        """Extends ``pages`` (in place) to hold ``tokens`` positions; False (and no change) if the pool is short."""
        need = self.pages_for(tokens) - len(pages)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        pages.extend(self._free.pop() for _ in range(need))
        return True

    def release(self, pages: list[int]) -> None:
        """Returns ``pages`` to the pool and empties the list."""
        self._free.extend(reversed(pages))
        pages.clear()
