"""Prefix caching: content-addressed pages (NumPy only, no jax).

Page i of a token sequence holds positions [i * page_size, (i + 1) * page_size). Its key chains a hash over
the key of page i - 1 and the page's token ids, so equal keys mean equal prefixes, and K/V that depend only on
the prefix (given the salt: model, dtype, geometry) can be shared. `PageIndex` is one layer group's map of
cached pages; `BatchControl` keeps one per group and decides when pages enter and leave it.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Hashable, Sequence

import numpy as np

KEY_BYTES = 16


def page_keys(tokens: Sequence[int], page_size: int, prev: bytes, start: int = 0) -> list[bytes]:
    """Keys of the full pages of `tokens` from page `start` on, chained from `prev` (the key of page
    start - 1, or the salt for start = 0)."""
    ids = np.asarray(tokens[start * page_size:], np.int64)
    keys = []
    for i in range(len(ids) // page_size):
        prev = hashlib.blake2b(prev + ids[i * page_size:(i + 1) * page_size].tobytes(),
                               digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def salt(*parts) -> bytes:
    """The chain's seed: a hash of whatever else changes the K/V (reprs of the parts)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=KEY_BYTES).digest()


class PageIndex:
    """One layer group's cached pages: key <-> page, and the unreferenced ones in LRU order (evictable).

    A cached page's contents are exactly its key's K/V: the owner of a cached page un-caches it before
    writing into it (`BatchControl.declare_step`).
    """

    def __init__(self) -> None:
        self.page_of: dict[Hashable, int] = {}
        self.key_of: dict[int, Hashable] = {}
        self.unused: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self.key_of)

    def leading(self, keys: Sequence[Hashable], limit: int) -> list[int]:
        """The cached pages of the longest run keys[0..] (at most `limit`)."""
        pages = []
        for key in keys[:limit]:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def add(self, key: Hashable, page: int) -> None:
        """Cache a referenced `page` under `key` (no-op when either is cached already)."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key] = page
            self.key_of[page] = key

    def drop(self, page: int) -> None:
        """Forget a page (its owner is about to overwrite it)."""
        key = self.key_of.pop(page, None)
        if key is not None:
            del self.page_of[key]
            self.unused.pop(page, None)

    def release(self, page: int) -> bool:
        """A page lost its last reference: True (kept, evictable) if it is cached, else False (free it)."""
        if page in self.key_of:
            self.unused[page] = None
            return True
        return False

    def acquire(self, page: int) -> None:
        """A cached page gains a reference (it stops being evictable)."""
        self.unused.pop(page, None)

    def evict(self) -> int:
        """Forget the least recently released unreferenced page and return it."""
        page, _ = self.unused.popitem(last=False)
        del self.page_of[self.key_of.pop(page)]
        return page
