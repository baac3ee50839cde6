"""Host bookkeeping for the paged KV cache: page tables, free lists, refcounts.

NumPy only (no jax): this runs on the host every step, beside the device state.

Every layer group (layers sharing a window) has its own page table
`i32[max_seqs, pages_per_seq]`, free list over pages 1..num_pages-1 and
refcounts; entry 0 means "no page" (page 0 is the scratch page for padding).

Step protocol: `declare_step` reserves pages and applies the step's page-table
changes at once, recording them in an undo log; `prepare_step` builds the device
metadata; `commit_step` makes the positions permanent, `abort_step` replays the
undo log backwards. While a step is pending, its sequences may not be cloned,
removed or rewound (ValueError): commit or abort first. A page a step copies
away from keeps its writer's reference until commit, so outside a pending step
every refcount equals the number of page-table entries naming the page.

The tables here are the truth; the device keeps a mirror, and a step carries only the entries set
since the last committed step (`StepMetadata.table_changes`; a step that aborts leaves them to the
next). Entries cleared here (a removed, rewound or aborted sequence's) are not sent, so the mirror
may keep a stale page there. That is safe because every entry stays a page id in [0, num_pages)
and the kernels mask every row at or past a sequence's kv_end (and outside its window), whatever
page it comes from: the same contract as the scratch page a cleared entry named before.

Prefix caching (`glint.kvcache.prefix`): `cache_pages` enters a sequence's full pages into a per-group
index under content keys; `seq_new(prefix)` maps the longest cached run of a new sequence's keys.
A cached page whose last reference goes stays cached (evictable, LRU) rather than free; a step
that needs pages takes free ones first, then evicts. A ring group caches only pages of its
first lap (positions below its ring rows, not yet overwritten), so a prefix is reused in every
group or not at all: a step computes every layer.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import NamedTuple, Sequence

import numpy as np

from glint.kvcache.config import CacheConfig
from glint.kvcache.prefix import PageIndex


class StepMetadata(NamedTuple):
    """Device metadata for one step (all int32 NumPy arrays; a pytree as is).

    positions: i32[T] position of each token (pads 0).
    slots: per group, i32[T] flat row `page * page_size + offset` to write
      (pads land in scratch page 0).
    seq_info: i32[S, 4] = (q_start, q_len, seq_slot, kv_end) per segment, in order
      of first token; seq_slot = the sequence id, its row of the page tables; pad segments all 0.
    table_changes: per group, i32[n, 3] (seq, page index, page): the page-table entries set since
      the last committed step, each (seq, index) once (its latest page), to apply to the device's
      copy of the tables before this step reads them.
    copies: per group, i32[n, 2] (src_page, dst_page) copy-on-write copies to
      apply to every layer of the group BEFORE this step's writes.
    token_seq: i32[T] sequence id per token, -1 for pads.
    num_tokens: declared (unpadded) tokens.
    """

    positions: np.ndarray
    slots: tuple[np.ndarray, ...]
    seq_info: np.ndarray
    table_changes: tuple[np.ndarray, ...]
    copies: tuple[np.ndarray, ...]
    token_seq: np.ndarray
    num_tokens: int


@dataclasses.dataclass
class _Step:
    """A declared, not yet committed step (arrays, so per-step cost stays low)."""

    seq_ids: np.ndarray  # i64[T] sequence per token
    token_pos: np.ndarray  # i64[T] position per token
    seg_seq: np.ndarray  # i64[S] sequence per segment, in order of first token
    seg_start: np.ndarray  # i64[S]
    seg_len: np.ndarray  # i64[S]
    # Undo log per group: (seq, page_index, new_page, old_page) i64[n] each;
    # old_page 0 = growth, else a copy-on-write source whose reference the
    # sequence keeps until commit.
    changes: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    sent: int = 0  # table entries logged when prepare_step ran: the ones its metadata carries


class BatchControl:
    """Page tables, free lists, refcounts and positions of every sequence.

    Misuse (unknown id, bad length, malformed step) raises ValueError; a refusal
    for lack of room or history returns None/False and changes nothing.
    """

    def __init__(self, cache_config: CacheConfig) -> None:
        cfg = cache_config
        self.config = cfg
        self._page_size = cfg.page_size
        self._num_groups = cfg.num_groups
        self._ring_rows = [cfg.group_ring_rows(g) for g in range(cfg.num_groups)]
        self._windows = list(cfg.group_windows)
        self._has_ring = any(r is not None for r in self._ring_rows)
        self._tables = [
            np.zeros((cfg.max_seqs, cfg.group_pages_per_seq(g)), np.int32) for g in range(cfg.num_groups)
        ]
        self._refcounts = [np.zeros(cfg.num_pages, np.int32) for _ in range(cfg.num_groups)]
        # Stacks: pop() hands out the lowest page first on a fresh cache.
        self._free_pages = [list(range(cfg.num_pages - 1, 0, -1)) for _ in range(cfg.num_groups)]
        self._free_ids = list(range(cfg.max_seqs))  # min-heap
        self._index = [PageIndex() for _ in range(cfg.num_groups)]
        # Pages a ring group can cache per sequence: the whole pages of its first lap.
        self._cacheable = [None if r is None else r // cfg.page_size for r in self._ring_rows]
        self._num_cached = np.zeros(cfg.max_seqs, np.int64)  # leading pages cache_pages has looked at
        self.evictions = 0  # cached pages reused for new data (all groups)
        self._active = np.zeros(cfg.max_seqs, bool)
        self._pos = np.zeros(cfg.max_seqs, np.int64)
        self._hw = np.zeros(cfg.max_seqs, np.int64)
        self._step: _Step | None = None
        # Page-table entries set since the device last got them, in order: (group, i64[n, 3] (seq, index, page)).
        self._unsent: list[tuple[int, np.ndarray]] = []

    # ---- queries ----------------------------------------------------------

    def pos(self, seq_id: int) -> int:
        """One past the newest committed position of `seq_id`."""
        return int(self._pos[self._check_id(seq_id)])

    def high_water(self, seq_id: int) -> int:
        """One past the highest position `seq_id` (or its clone source) ever wrote."""
        return int(self._hw[self._check_id(seq_id)])

    def active_seqs(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(self._active)]

    def num_free_pages(self, group: int) -> int:
        """Pages a step can take: free ones and cached ones no sequence references."""
        g = self._check_group(group)
        return len(self._free_pages[g]) + len(self._index[g].unused)

    def num_cached_pages(self, group: int) -> int:
        """Pages of `group` in the prefix cache, referenced or not."""
        return len(self._index[self._check_group(group)])

    def cached_pages(self, group: int) -> dict[int, object]:
        """{page: key} of `group`'s prefix cache (a copy)."""
        return dict(self._index[self._check_group(group)].key_of)

    def evictable_pages(self, group: int) -> list[int]:
        """Cached pages no sequence references, the next to be evicted first."""
        return list(self._index[self._check_group(group)].unused)

    def pages_in_use(self, group: int) -> int:
        return self.config.num_pages - 1 - self.num_free_pages(group)

    def page_table(self, group: int) -> np.ndarray:
        """Read-only view of `group`'s page table, i32[max_seqs, pages_per_seq]."""
        view = self._tables[self._check_group(group)].view()
        view.flags.writeable = False
        return view

    def refcounts(self, group: int) -> np.ndarray:
        """Read-only view of `group`'s refcounts, i32[num_pages]."""
        view = self._refcounts[self._check_group(group)].view()
        view.flags.writeable = False
        return view

    def free_page_list(self, group: int) -> list[int]:
        return list(self._free_pages[self._check_group(group)])

    @property
    def has_pending_step(self) -> bool:
        return self._step is not None

    def can_admit(self, num_tokens: int = 1) -> bool:
        """Whether a new sequence of `num_tokens` tokens fits now (id and pages)."""
        if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"num_tokens = {num_tokens!r}, must be an int >= 0")
        if not self._free_ids or num_tokens > self.config.capacity:
            return False
        for g in range(self._num_groups):
            rows = num_tokens if self._ring_rows[g] is None else min(num_tokens, self._ring_rows[g])
            if -(-rows // self._page_size) > self.num_free_pages(g):
                return False
        return True

    def can_extend(self, seq_id: int, num_tokens: int) -> bool:
        """Whether `seq_id` could write `num_tokens` more tokens in a step of its own now."""
        seq = self._check_id(seq_id)
        pos = int(self._pos[seq])
        if pos + num_tokens > self.config.capacity:
            return False
        ids = np.full(num_tokens, seq, np.int64)
        token_pos = pos + np.arange(num_tokens)
        return all(int(self._plan(g, ids, token_pos)[3].sum()) <= self.num_free_pages(g)
                   for g in range(self._num_groups))

    # ---- sequence lifecycle -----------------------------------------------

    def seq_new(self, prefix: Sequence[object] = ()) -> int | None:
        """A new sequence id (also its page-table row), or None if none is free.

        `prefix`: the page keys of the sequence's first pages (`prefix.page_keys`); the longest leading
        run cached in every group is mapped, shared copy-on-write, and `pos` starts after it.
        """
        if not self._free_ids:
            return None
        seq = self._take_id()
        runs = [self._index[g].leading(prefix, self._tables[g].shape[1] if c is None else c)
                for g, c in enumerate(self._cacheable)]
        num_pages = min(len(run) for run in runs) if runs else 0
        for g, run in enumerate(runs):
            pages = np.array(run[:num_pages], np.int64)
            self._set_entries(g, np.full(num_pages, seq), np.arange(num_pages), pages)
            self._refcounts[g][pages] += 1
            for page in pages[self._refcounts[g][pages] == 1].tolist():
                self._index[g].acquire(page)
        self._pos[seq] = self._hw[seq] = num_pages * self._page_size
        self._num_cached[seq] = num_pages
        return seq

    def cache_pages(self, seq_id: int, keys: Sequence[object]) -> None:
        """Enter `seq_id`'s full pages into the prefix cache: page i under keys[i], for the pages below
        pos() that `keys` covers (keys[i]: the key of the sequence's own tokens of page i)."""
        seq = self._check_id(seq_id)
        self._check_not_pending(seq, "cache_pages")  # a pending step may be about to overwrite its pages
        start = int(self._num_cached[seq])
        end = min(len(keys), int(self._pos[seq]) // self._page_size)
        if end <= start:
            return
        for g, cacheable in enumerate(self._cacheable):
            lo, hi = start, end
            if cacheable is not None:  # first-lap pages the ring has not yet overwritten (hw <= i*P + R)
                lo = max(lo, -(-(int(self._hw[seq]) - self._ring_rows[g]) // self._page_size))
                hi = min(hi, cacheable)
            row, index = self._tables[g][seq], self._index[g]
            for i in range(lo, hi):
                index.add(keys[i], int(row[i]))
        self._num_cached[seq] = end

    def seq_clone(self, src: int, upto: int | None = None) -> int | None:
        """A new sequence owning `src`'s first `upto` positions (default all).

        Pages are shared by refcount and copied on the first write. None when no
        id is free or `upto` is below a ring floor of `src`.
        """
        src = self._check_id(src)
        self._check_not_pending(src, "seq_clone")
        src_pos = int(self._pos[src])
        upto = src_pos if upto is None else upto
        if not isinstance(upto, (int, np.integer)) or not 0 <= upto <= src_pos:
            raise ValueError(f"upto = {upto!r} for sequence {src}, must be in [0, pos={src_pos}]")
        upto = int(upto)
        if not self._free_ids or (upto > 0 and not self._above_ring_floor(src, upto)):
            return None
        seq = self._take_id()
        if upto == 0:
            return seq  # owns nothing, so it inherits no history either
        for g in range(self._num_groups):
            row = self._tables[g][src]
            if self._ring_rows[g] is None:
                row = row[: -(-upto // self._page_size)]
            # Ring groups share every stored row: the window ends anywhere in the ring.
            index = np.flatnonzero(row)
            pages = row[index]
            self._set_entries(g, np.full(len(index), seq), index, pages)
            self._refcounts[g][pages] += 1  # pages within a row are distinct
        self._pos[seq] = upto
        self._hw[seq] = self._hw[src]
        self._num_cached[seq] = min(int(self._num_cached[src]), upto // self._page_size)
        return seq

    def seq_rm(self, seq_id: int) -> None:
        """Release `seq_id`; each of its pages frees when its last owner leaves."""
        seq = self._check_id(seq_id)
        self._check_not_pending(seq, "seq_rm")
        for g in range(self._num_groups):
            self._release_pages(g, seq, 0)
        self._active[seq] = False
        self._pos[seq] = 0
        self._hw[seq] = 0
        self._num_cached[seq] = 0
        heapq.heappush(self._free_ids, seq)

    def rewind(self, seq_id: int, new_len: int) -> bool:
        """Truncate `seq_id` to positions [0, new_len).

        False (no change) if a ring layer no longer stores the window a query at
        `new_len` would see. Flat groups free pages wholly beyond `new_len`;
        `new_len == 0` frees everything and resets the high water.
        """
        seq = self._check_id(seq_id)
        self._check_not_pending(seq, "rewind")
        pos = int(self._pos[seq])
        if not isinstance(new_len, (int, np.integer)) or not 0 <= new_len <= pos:
            raise ValueError(f"new_len = {new_len!r} for sequence {seq}, must be in [0, pos={pos}]")
        new_len = int(new_len)
        if new_len == 0:
            for g in range(self._num_groups):
                self._release_pages(g, seq, 0)
            self._pos[seq] = 0
            self._hw[seq] = 0
            self._num_cached[seq] = 0
            return True
        if not self._above_ring_floor(seq, new_len):
            return False
        for g in range(self._num_groups):
            if self._ring_rows[g] is None:
                self._release_pages(g, seq, -(-new_len // self._page_size))
        self._pos[seq] = new_len
        self._num_cached[seq] = min(int(self._num_cached[seq]), new_len // self._page_size)
        return True

    # ---- step protocol ----------------------------------------------------

    def declare_step(self, seq_ids: Sequence[int]) -> bool:
        """Declare the sequence of each token of the next step, in step order.

        Each sequence's tokens form one contiguous run continuing at pos(id).
        Reserves the pages the step writes (growth and copy-on-write copies);
        False and no change if pages run out or a sequence would pass capacity.
        A step still pending is aborted first, even if this one is refused.
        """
        ids = np.asarray(seq_ids, dtype=np.int64).reshape(-1)
        seg_seq, seg_start, seg_len = self._parse_step(ids)
        if self._step is not None:
            self.abort_step()
        seg_pos = self._pos[seg_seq]
        if (seg_pos + seg_len > self.config.capacity).any():
            return False
        token_pos = np.repeat(seg_pos - seg_start, seg_len) + np.arange(len(ids))
        plans = []
        for g in range(self._num_groups):
            seqs, index, pages, need = self._plan(g, ids, token_pos)
            if int(need.sum()) > self.num_free_pages(g):
                return False
            plans.append((seqs, index, pages, need))
        changes = []
        for g, (seqs, index, pages, need) in enumerate(plans):
            for page in pages[~need].tolist():  # written in place: its cached contents are about to change
                self._index[g].drop(page)
            seqs, index, old = seqs[need], index[need], pages[need]
            new = self._take_pages(g, len(old))
            self._refcounts[g][new] = 1
            self._set_entries(g, seqs, index, new)
            changes.append((seqs, index, new, old))
        self._step = _Step(ids, token_pos, seg_seq, seg_start, seg_len, changes)
        return True

    def prepare_step(self, width: int | None = None, num_segments: int | None = None) -> StepMetadata:
        """Device metadata of the pending step, tokens padded to `width`.

        `num_segments` pads the segment axis (default min(width, max_seqs)).
        """
        step = self._require_step("prepare_step")
        cfg = self.config
        num_tokens = len(step.seq_ids)
        width = num_tokens if width is None else width
        if not isinstance(width, (int, np.integer)) or width < num_tokens:
            raise ValueError(f"width = {width!r}, must be >= the {num_tokens} declared tokens")
        num_seqs = len(step.seg_seq)
        if num_segments is None:
            num_segments = min(width, cfg.max_seqs)
        if not isinstance(num_segments, (int, np.integer)) or num_segments < num_seqs:
            raise ValueError(f"num_segments = {num_segments!r}, must be >= the {num_seqs} sequences in the step")

        positions = np.zeros(width, np.int32)
        positions[:num_tokens] = step.token_pos
        token_seq = np.full(width, -1, np.int32)
        token_seq[:num_tokens] = step.seq_ids
        # Pads write to distinct rows of the scratch page while width allows.
        pad_slots = np.arange(width - num_tokens, dtype=np.int32) % cfg.page_size
        slots, copies = [], []
        step.sent = len(self._unsent)
        for g in range(self._num_groups):
            table = self._tables[g]
            ring_rows = self._ring_rows[g]
            rows = step.token_pos if ring_rows is None else step.token_pos % ring_rows
            pages = table[step.seq_ids, rows // cfg.page_size]
            slots.append(np.concatenate([pages * cfg.page_size + rows % cfg.page_size, pad_slots]).astype(np.int32))
            _, _, new, old = step.changes[g]
            is_copy = old > 0
            copies.append(np.stack([old[is_copy], new[is_copy]], axis=1).astype(np.int32))

        seq_info = np.zeros((num_segments, 4), np.int32)
        seq_info[:num_seqs, 0] = step.seg_start
        seq_info[:num_seqs, 1] = step.seg_len
        seq_info[:num_seqs, 2] = step.seg_seq
        seq_info[:num_seqs, 3] = self._pos[step.seg_seq] + step.seg_len
        return StepMetadata(
            positions, tuple(slots), seq_info, self.table_changes(), tuple(copies), token_seq, num_tokens
        )

    def table_changes(self) -> tuple[np.ndarray, ...]:
        """Per group i32[n, 3] (seq, page index, page): the entries set and not yet sent to the device, each
        (seq, index) once with its latest page, in (seq, index) order."""
        out = []
        for g in range(self._num_groups):
            logged = [entries for group, entries in self._unsent if group == g]
            if not logged:
                out.append(np.zeros((0, 3), np.int32))
                continue
            entries = np.concatenate(logged)
            keys = entries[::-1, 0] * self._tables[g].shape[1] + entries[::-1, 1]
            _, last = np.unique(keys, return_index=True)  # the first of the reversed log: the latest write
            out.append(entries[::-1][last].astype(np.int32))
        return tuple(out)

    def take_table_changes(self) -> tuple[np.ndarray, ...]:
        """`table_changes()`, then forget them: for a caller that sends them to the device itself
        (programs.Runner.update_tables) outside a step."""
        changes = self.table_changes()
        self._unsent.clear()
        return changes

    def commit_step(self) -> None:
        """Make the pending step's positions permanent (after the device ran it, with the table changes its
        prepared metadata carried: those are no longer pending). The metadata is that of the last
        `prepare_step`: a caller that prepared twice runs the second."""
        step = self._require_step("commit_step")
        del self._unsent[:step.sent]
        for g, (_, _, _, old) in enumerate(step.changes):
            old = old[old > 0]
            if len(old):
                refcounts = self._refcounts[g]
                np.subtract.at(refcounts, old, 1)  # two writers may have copied one page
                self._free(g, np.unique(old[refcounts[old] == 0]))
        self._pos[step.seg_seq] += step.seg_len
        self._hw[step.seg_seq] = np.maximum(self._hw[step.seg_seq], self._pos[step.seg_seq])
        self._step = None

    def abort_step(self) -> None:
        """Undo the pending step: free its pages and restore copied-from pages.

        Host state returns to what it was, except that with ring groups each
        step sequence's high water rises to pos + q_len: the device may already
        have written those ring rows, overwriting positions the floor must now
        treat as gone. (Flat rows written past pos are never read; shared pages
        were never written in place, see declare_step.)
        """
        step = self._require_step("abort_step")
        for g, (seqs, index, new, old) in enumerate(step.changes):
            self._tables[g][seqs, index] = old
            copied = old > 0  # the device may hold the new page already: name the old one again
            self._set_entries(g, seqs[copied], index[copied], old[copied], store=False)
            self._refcounts[g][new] = 0
            self._free_pages[g].extend(new[::-1].tolist())  # back in the order declare took them (evicted ones too)
        if self._has_ring:
            end = self._pos[step.seg_seq] + step.seg_len
            self._hw[step.seg_seq] = np.maximum(self._hw[step.seg_seq], end)
        self._step = None

    # ---- internals --------------------------------------------------------

    def _check_id(self, seq_id: int) -> int:
        if (
            not isinstance(seq_id, (int, np.integer))
            or not 0 <= seq_id < self.config.max_seqs
            or not self._active[seq_id]
        ):
            raise ValueError(f"unknown sequence id {seq_id!r} (active: {self.active_seqs()})")
        return int(seq_id)

    def _take_id(self) -> int:
        seq = heapq.heappop(self._free_ids)
        self._active[seq] = True
        self._pos[seq] = 0
        self._hw[seq] = 0
        return seq

    def _check_group(self, group: int) -> int:
        if not isinstance(group, (int, np.integer)) or not 0 <= group < self._num_groups:
            raise ValueError(f"group = {group!r}, must be in [0, {self._num_groups})")
        return int(group)

    def _check_not_pending(self, seq: int, what: str) -> None:
        if self._step is not None and seq in self._step.seg_seq:
            raise ValueError(f"{what}: sequence {seq} is in the pending step; commit_step() or abort_step() first")

    def _require_step(self, what: str) -> _Step:
        if self._step is None:
            raise ValueError(f"{what}: no step declared")
        return self._step

    def _parse_step(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seq, q_start, q_len) arrays, one per contiguous run; ValueError if malformed."""
        num_tokens = len(ids)
        if num_tokens == 0:
            raise ValueError("declare_step: empty step")
        if num_tokens > self.config.max_write:
            raise ValueError(f"declare_step: {num_tokens} tokens, more than max_write = {self.config.max_write}")
        is_known = (ids >= 0) & (ids < self.config.max_seqs)
        is_known[is_known] = self._active[ids[is_known]]
        if not is_known.all():
            self._check_id(int(ids[np.argmin(is_known)]))
        starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
        seqs = ids[starts]
        if len(np.unique(seqs)) != len(seqs):
            raise ValueError(f"declare_step: a sequence's tokens are not one contiguous run: {ids.tolist()}")
        q_lens = np.diff(np.append(starts, num_tokens))
        if q_lens.max() > self.config.max_seq_write:
            i = int(np.argmax(q_lens))
            raise ValueError(f"declare_step: sequence {int(seqs[i])} writes {int(q_lens[i])} tokens, more than "
                             f"max_seq_write = {self.config.max_seq_write}")
        return seqs, starts, q_lens

    def _above_ring_floor(self, seq: int, length: int) -> bool:
        """Whether every ring group still stores the window a query at `length` sees."""
        hw = int(self._hw[seq])
        for window, ring_rows in zip(self._windows, self._ring_rows):
            if ring_rows is not None and max(0, length - window + 1) < hw - ring_rows:
                return False
        return True

    def _plan(self, group: int, ids: np.ndarray, token_pos: np.ndarray):
        """The (sequence, page index) pairs tokens at `token_pos` of `ids` write in `group`, each once:
        (seqs, index, current page, whether it needs a new page)."""
        table = self._tables[group]
        ring_rows = self._ring_rows[group]
        rows = token_pos if ring_rows is None else token_pos % ring_rows
        keys = np.unique(ids * table.shape[1] + rows // self._page_size)
        seqs, index = np.divmod(keys, table.shape[1])
        pages = table[seqs, index]
        # A page shared at declare time is copied by every writer (even the
        # last one), so an abort leaves shared pages untouched.
        need = (pages == 0) | (self._refcounts[group][pages] > 1)
        return seqs, index, pages, need

    def _take_pages(self, group: int, count: int) -> np.ndarray:
        """`count` pages for new data: free ones first (as if popped one by one), then evicted cached ones."""
        free = self._free_pages[group]
        num_free = min(count, len(free))
        pages = free[len(free) - num_free:][::-1]
        del free[len(free) - num_free:]
        for _ in range(count - num_free):
            pages.append(self._index[group].evict())
            self.evictions += 1
        return np.array(pages, np.int64)

    def _free(self, group: int, pages: np.ndarray) -> None:
        """Pages whose last reference went: cached ones become evictable (in this order), the rest free."""
        index = self._index[group]
        self._free_pages[group].extend(p for p in pages.tolist() if not index.release(p))

    def _set_entries(self, group: int, seqs, index, pages, store: bool = True) -> None:
        """Set (store=False: only log) page-table entries, logged for the device's copy."""
        if store:
            self._tables[group][seqs, index] = pages
        if len(pages):
            self._unsent.append((group, np.stack([seqs, index, pages], axis=1).astype(np.int64)))

    def _release_pages(self, group: int, seq: int, keep: int) -> None:
        """Drop `seq`'s references to its pages at indices >= keep (the last page first: evicted first)."""
        row = self._tables[group][seq, keep:]
        pages = row[row > 0]
        if len(pages):
            refcounts = self._refcounts[group]
            refcounts[pages] -= 1  # pages within a row are distinct
            self._free(group, pages[refcounts[pages] == 0][::-1])
            row[:] = 0
