"""BatchControl against a plain-Python model and a simulated NumPy device.

The simulated device keeps one pool of int tags per layer group (every layer of
a group uses the same page ids), applies the reported copy-on-write copies
before the step's writes exactly as the real device does, and writes a unique
tag per (sequence, position, step). After every operation each sequence must
read back its own tags through its page table.

Prefix caching: every written position also gets a token (from a two-letter
alphabet, so prefixes collide often); the machine records which token prefix
each tag was computed from, and every position a sequence reads, and every row
of every cached page, must hold a tag computed from exactly its own prefix.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from glint.kvcache import BatchControl, CacheConfig
from glint.kvcache.prefix import page_keys, salt

SALT = salt("test")


def make_config(**overrides) -> CacheConfig:
    fields = dict(
        page_size=4, num_pages=40, max_seqs=4, max_write=8, capacity=64,
        windows=(0, 8, 0, 8), kv_heads=2, head_dim=8,
    )
    fields.update(overrides)
    return CacheConfig(**fields)


class Device:
    """One tag pool per group, [num_pages, page_size]; 0 means never written. Its own page tables, kept from the
    changes each step carries, as the engine's device keeps them."""

    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.pools = [np.zeros((cfg.num_pages, cfg.page_size), np.int64) for _ in range(cfg.num_groups)]
        self.tables = [np.zeros((cfg.max_seqs, cfg.group_pages_per_seq(g)), np.int64) for g in range(cfg.num_groups)]
        self.tags = itertools.count(1)

    def run(self, meta, control: BatchControl) -> list[int]:
        """Apply the table changes and copies, then write fresh tags at the step's slots; returns the tags."""
        n = meta.num_tokens
        for g, (table, changes) in enumerate(zip(self.tables, meta.table_changes)):
            assert changes.dtype == np.int32 and changes.shape[1:] == (3,)
            keys = changes[:, 0].astype(np.int64) * table.shape[1] + changes[:, 1]
            assert len(set(keys.tolist())) == len(keys), "an entry changed twice in one step"
            assert (changes[:, 2] > 0).all(), "cleared entries are not sent"
            table[changes[:, 0], changes[:, 1]] = changes[:, 2]
            # Every entry the host holds, the device holds too (cleared ones may stay stale there).
            host = control.page_table(g)
            set_ = host > 0
            np.testing.assert_array_equal(table[set_], host[set_], err_msg=f"group {g}: device tables behind")
        for s, (q_start, q_len, seq, kv_end) in enumerate(meta.seq_info.tolist()):
            if q_len:  # the rows the kernels read: every page below kv_end (flat) or of the window (ring)
                for g, table in enumerate(self.tables):
                    ring_rows = self.cfg.group_ring_rows(g)
                    first = 0 if ring_rows is None else max(0, kv_end - ring_rows)
                    rows = np.arange(first, kv_end) % (ring_rows or 1 << 62)
                    assert (table[seq, rows // self.cfg.page_size] > 0).all(), f"seq {seq} reads a missing page"
        for g, pool in enumerate(self.pools):
            copies = meta.copies[g]
            if len(copies):
                assert len(set(copies[:, 1].tolist())) == len(copies), "two copies into one page"
                assert not set(copies[:, 1].tolist()) & set(copies[:, 0].tolist())
                pool[copies[:, 1]] = pool[copies[:, 0]]
        tags = [next(self.tags) for _ in range(n)]
        for g, pool in enumerate(self.pools):
            slots = meta.slots[g]
            assert (slots[n:] < self.cfg.page_size).all(), "pad rows must write to scratch page 0"
            pages = slots[:n] // self.cfg.page_size
            assert (pages > 0).all(), "a real row writes to the scratch page"
            # A page written in place must not be visible to any other sequence.
            assert (control.refcounts(g)[pages] == 1).all(), f"group {g} writes into a shared page"
            pool.reshape(-1)[slots[:n]] = tags
            pool.reshape(-1)[slots[n:]] = -1
        return tags

    def read(self, control: BatchControl, group: int, seq: int, position: int) -> int:
        ring_rows = self.cfg.group_ring_rows(group)
        row = position if ring_rows is None else position % ring_rows
        page = control.page_table(group)[seq, row // self.cfg.page_size]
        assert page > 0, f"seq {seq} position {position} has no page in group {group}"
        return int(self.pools[group][page, row % self.cfg.page_size])


def snapshot(control: BatchControl) -> tuple:
    cfg = control.config
    groups = range(cfg.num_groups)
    return (
        [control.page_table(g).copy() for g in groups],
        [control.refcounts(g).copy() for g in groups],
        [control.free_page_list(g) for g in groups],
        {s: (control.pos(s), control.high_water(s)) for s in control.active_seqs()},
        control.has_pending_step,
    )


def assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        np.testing.assert_array_equal(x, y)
    assert a[2:] == b[2:]


def check_pages(control: BatchControl) -> None:
    """Refcounts equal page-table references; free and used pages partition 1..N-1."""
    cfg = control.config
    for g in range(cfg.num_groups):
        table = control.page_table(g)
        refs = np.bincount(table.reshape(-1), minlength=cfg.num_pages)
        refs[0] = 0
        np.testing.assert_array_equal(control.refcounts(g), refs, err_msg=f"group {g}")
        free = control.free_page_list(g)
        assert len(free) == len(set(free)), f"group {g}: page freed twice"
        assert 0 not in free
        used = set(np.flatnonzero(refs).tolist())
        assert not used & set(free), f"group {g}: pages both free and used: {used & set(free)}"
        cached, evictable = set(control.cached_pages(g)), control.evictable_pages(g)
        assert len(evictable) == len(set(evictable)) and set(evictable) <= cached
        assert not cached & set(free), f"group {g}: pages both free and cached: {cached & set(free)}"
        assert set(evictable) == cached - used, f"group {g}: evictable pages must be exactly the unreferenced cached"
        assert used | set(free) | cached == set(range(1, cfg.num_pages)), f"group {g}: leaked pages"
        assert len(free) + len(evictable) == control.num_free_pages(g)
        for seq in range(cfg.max_seqs):
            row = table[seq]
            assert len(set(row[row > 0].tolist())) == int((row > 0).sum()), "page twice in one row"
        for seq in set(range(cfg.max_seqs)) - set(control.active_seqs()):
            assert not table[seq].any(), f"removed seq {seq} still holds pages"


def floor_ok(cfg: CacheConfig, hw: int, new_len: int) -> bool:
    if new_len == 0:
        return True
    for g, window in enumerate(cfg.group_windows):
        if window and max(0, new_len - window + 1) < hw - cfg.group_ring_rows(g):
            return False
    return True


class KVControlMachine(RuleBasedStateMachine):
    @initialize(
        windows=st.sampled_from([(0, 8, 0, 8), (0,), (5,), (0, 3, 8), (8, 8)]),
        page_size=st.sampled_from([1, 2, 4]),
        max_write=st.integers(4, 8),
        max_seq_write=st.integers(1, 8),  # a per-sequence limit below max_write shrinks the rings
        capacity=st.sampled_from([24, 64]),
        num_pages=st.integers(6, 48),
        max_seqs=st.integers(1, 5),
    )
    def setup(self, windows, page_size, max_write, max_seq_write, capacity, num_pages, max_seqs):
        self.cfg = make_config(
            windows=windows, page_size=page_size, max_write=max_write, max_seq_write=min(max_seq_write, max_write),
            capacity=capacity, num_pages=num_pages, max_seqs=max_seqs,
        )
        self.control = BatchControl(self.cfg)
        self.device = Device(self.cfg)
        # id -> {"tags": [...], "tokens": [...], "hw": int, "mapped": per group, the tags of the mapped prefix}
        self.seqs: dict[int, dict] = {}
        self.prefix_of_tag: dict[int, tuple] = {}  # the token prefix each written tag was computed from
        self.prefix_of_key: dict[bytes, tuple] = {}

    def _keys(self, tokens: list[int]) -> list[bytes]:
        keys = page_keys(tokens, self.cfg.page_size, SALT)
        for i, key in enumerate(keys):
            self.prefix_of_key[key] = tuple(tokens[:(i + 1) * self.cfg.page_size])
        return keys

    def _pick(self, data) -> int:
        """An active sequence id (creating one if none is active)."""
        if not self.seqs:
            self.new()
        return data.draw(st.sampled_from(sorted(self.seqs)))

    # ---- rules ------------------------------------------------------------

    @rule(prompt=st.lists(st.integers(0, 1), max_size=24))
    def new(self, prompt=()):
        """A new sequence, mapping whatever prefix of `prompt` the cache holds."""
        keys = self._keys(list(prompt))
        seq = self.control.seq_new(keys)
        if len(self.seqs) == self.cfg.max_seqs:
            assert seq is None
            return
        assert seq is not None and seq not in self.seqs
        m = self.control.pos(seq)
        assert m % self.cfg.page_size == 0 and m <= len(keys) * self.cfg.page_size
        assert self.control.high_water(seq) == m
        # Groups may map different pages (computed by different sequences) of the same prefix.
        mapped = [[self.device.read(self.control, g, seq, p) for p in range(m)] for g in range(self.cfg.num_groups)]
        for tags in mapped:
            for p, tag in enumerate(tags):
                assert self.prefix_of_tag[tag] == tuple(prompt[:p + 1]), "a mapped page holds another prefix's K/V"
        if m:
            event("prefix hit")
        self.seqs[seq] = {"tags": list(mapped[0]), "tokens": list(prompt[:m]), "hw": m, "mapped": mapped}

    @rule(data=st.data())
    def cache(self, data):
        """Enter a sequence's full pages into the prefix cache (possibly late: after a ring wrapped)."""
        seq = self._pick(data)
        self.control.cache_pages(seq, self._keys(self.seqs[seq]["tokens"]))

    @rule(data=st.data())
    def clone(self, data):
        src = self._pick(data)
        model = self.seqs[src]
        upto = data.draw(st.one_of(st.none(), st.integers(0, len(model["tags"]))))
        n = len(model["tags"]) if upto is None else upto
        before = snapshot(self.control)
        seq = self.control.seq_clone(src, upto)
        if len(self.seqs) == self.cfg.max_seqs or not floor_ok(self.cfg, model["hw"], n):
            assert seq is None
            assert_same(before, snapshot(self.control))
            event("clone refused")
            return
        assert seq is not None and seq not in self.seqs
        self.seqs[seq] = {"tags": model["tags"][:n], "tokens": model["tokens"][:n], "hw": model["hw"] if n else 0,
                          "mapped": [tags[:n] for tags in model["mapped"]]}

    @rule(data=st.data())
    def remove(self, data):
        seq = self._pick(data)
        self.control.seq_rm(seq)
        del self.seqs[seq]

    @rule(data=st.data())
    def rewind(self, data):
        seq = self._pick(data)
        model = self.seqs[seq]
        new_len = data.draw(st.integers(0, len(model["tags"])))
        before = snapshot(self.control)
        ok = self.control.rewind(seq, new_len)
        assert ok == floor_ok(self.cfg, model["hw"], new_len)
        if not ok:
            assert_same(before, snapshot(self.control))
            event("rewind refused by ring floor")
            return
        del model["tags"][new_len:]
        del model["tokens"][new_len:]
        for tags in model["mapped"]:
            del tags[new_len:]
        if new_len == 0:
            model["hw"] = 0

    @rule(data=st.data(), outcome=st.sampled_from(["commit", "abort_after_run", "abort_before_run"]))
    def step(self, data, outcome):
        cfg = self.cfg
        self._pick(data)
        order = data.draw(st.permutations(sorted(self.seqs)))
        order = order[: data.draw(st.integers(1, len(order)))]
        budget = cfg.max_write
        runs = []
        for seq in order:
            if budget == 0:
                break
            q_len = data.draw(st.integers(1, min(budget, cfg.max_seq_write)))
            budget -= q_len
            runs.append((seq, q_len))
        seq_ids = [seq for seq, q_len in runs for _ in range(q_len)]
        new_tokens = [data.draw(st.lists(st.integers(0, 1), min_size=q_len, max_size=q_len)) for _, q_len in runs]
        before = snapshot(self.control)
        free_before = [self.control.num_free_pages(g) for g in range(cfg.num_groups)]
        evictions = self.control.evictions
        if not self.control.declare_step(seq_ids):
            assert_same(before, snapshot(self.control))
            too_long = any(len(self.seqs[s]["tags"]) + q > cfg.capacity for s, q in runs)
            # Otherwise some group must lack pages: its need is at most the pages touched.
            touched = [
                sum(len(self._touched(g, len(self.seqs[s]["tags"]), q)) for s, q in runs)
                for g in range(cfg.num_groups)
            ]
            assert too_long or any(t > f for t, f in zip(touched, free_before))
            event("declare refused")
            return
        if self.control.evictions > evictions:
            event("cached pages evicted")
        width = len(seq_ids) + data.draw(st.integers(0, 3))
        meta = self.control.prepare_step(width)
        self._check_meta(meta, runs, width)
        if any(len(c) for c in meta.copies):
            event("copy-on-write copies")
        if any(hw >= 2 * (self.cfg.group_ring_rows(g) or 10**9) for g in range(self.cfg.num_groups)
               for hw in (m["hw"] for m in self.seqs.values())):
            event("ring wrapped twice")
        tags = None
        if outcome != "abort_before_run":
            tags = self.device.run(meta, self.control)
            self._record(runs, new_tokens, tags)
        if outcome == "commit":
            self.control.commit_step()
            for (seq, q_len), toks in zip(runs, new_tokens):
                model = self.seqs[seq]
                model["tags"].extend(tags[:q_len])
                model["tokens"].extend(toks)
                tags = tags[q_len:]
                model["hw"] = max(model["hw"], len(model["tags"]))
                if data.draw(st.booleans()):
                    self.control.cache_pages(seq, self._keys(model["tokens"]))
        else:
            self.control.abort_step()
            if any(cfg.group_windows):  # ring rows may have been written
                for seq, q_len in runs:
                    model = self.seqs[seq]
                    model["hw"] = max(model["hw"], len(model["tags"]) + q_len)
            for g in range(cfg.num_groups):
                assert self.control.num_free_pages(g) == free_before[g]

    @rule(data=st.data(), num_steps=st.integers(1, 8))
    def grow(self, data, num_steps):
        """Several committed full-width steps of one sequence: reaches ring wraps fast."""
        seq = self._pick(data)
        model = self.seqs[seq]
        for _ in range(num_steps):
            q_len = min(self.cfg.max_seq_write, self.cfg.capacity - len(model["tags"]))
            if q_len == 0 or not self.control.declare_step([seq] * q_len):
                return
            toks = data.draw(st.lists(st.integers(0, 1), min_size=q_len, max_size=q_len))
            tags = self.device.run(self.control.prepare_step(), self.control)
            self._record([(seq, q_len)], [toks], tags)
            self.control.commit_step()
            model["tags"].extend(tags)
            model["tokens"].extend(toks)
            model["hw"] = max(model["hw"], len(model["tags"]))
            self.control.cache_pages(seq, self._keys(model["tokens"]))

    def _record(self, runs, new_tokens, tags) -> None:
        """Remember the token prefix each tag a step wrote was computed from."""
        for (seq, q_len), toks in zip(runs, new_tokens):
            prefix = self.seqs[seq]["tokens"]
            for i in range(q_len):
                self.prefix_of_tag[tags[i]] = tuple(prefix) + tuple(toks[:i + 1])
            tags = tags[q_len:]

    def _touched(self, group: int, pos: int, q_len: int) -> set[int]:
        ring_rows = self.cfg.group_ring_rows(group)
        rows = [p if ring_rows is None else p % ring_rows for p in range(pos, pos + q_len)]
        return {r // self.cfg.page_size for r in rows}

    def _check_meta(self, meta, runs, width: int) -> None:
        cfg = self.cfg
        n = sum(q for _, q in runs)
        assert meta.num_tokens == n
        assert meta.positions.shape == meta.token_seq.shape == (width,)
        num_segments = min(width, cfg.max_seqs)
        assert meta.seq_info.shape == (num_segments, 4)
        start = 0
        for s, (seq, q_len) in enumerate(runs):
            pos = len(self.seqs[seq]["tags"])
            np.testing.assert_array_equal(meta.positions[start:start + q_len], np.arange(pos, pos + q_len))
            assert (meta.token_seq[start:start + q_len] == seq).all()
            assert meta.seq_info[s].tolist() == [start, q_len, seq, pos + q_len]
            start += q_len
        assert (meta.seq_info[len(runs):] == 0).all()
        assert (meta.token_seq[n:] == -1).all() and (meta.positions[n:] == 0).all()
        for g in range(cfg.num_groups):
            assert meta.slots[g].dtype == np.int32 and meta.table_changes[g].dtype == np.int32
            assert meta.copies[g].shape[1:] == (2,)

    # ---- invariants -------------------------------------------------------

    @invariant()
    def pages_consistent(self):
        if hasattr(self, "control"):
            check_pages(self.control)

    @invariant()
    def cached_pages_hold_their_prefix(self):
        if not hasattr(self, "control"):
            return
        size = self.cfg.page_size
        for g in range(self.cfg.num_groups):
            for page, key in self.control.cached_pages(g).items():
                prefix = self.prefix_of_key[key]
                start = len(prefix) - size
                for r in range(size):
                    tag = int(self.device.pools[g][page, r])
                    assert self.prefix_of_tag.get(tag) == prefix[:start + r + 1], \
                        f"group {g}: cached page {page} row {r} does not hold its key's K/V"

    @invariant()
    def sequences_read_back(self):
        if not hasattr(self, "control"):
            return
        control, cfg = self.control, self.cfg
        assert sorted(self.seqs) == control.active_seqs()
        for seq, model in self.seqs.items():
            pos, hw = len(model["tags"]), model["hw"]
            assert control.pos(seq) == pos and control.high_water(seq) == hw
            for g in range(cfg.num_groups):
                ring_rows = cfg.group_ring_rows(g)
                row = control.page_table(g)[seq]
                if ring_rows is None:
                    # Flat groups hold exactly the pages of written positions.
                    held = -(-pos // cfg.page_size)
                    assert (row[:held] > 0).all() and not row[held:].any()
                    first = 0
                else:
                    first = max(0, hw - ring_rows)
                    # The window a query at pos sees is always stored.
                    assert pos == 0 or max(0, pos - cfg.group_windows[g] + 1) >= first
                for p in range(first, pos):
                    got = self.device.read(control, g, seq, p)
                    mapped = model["mapped"][g]
                    want = mapped[p] if p < len(mapped) else model["tags"][p]
                    assert got == want, f"seq {seq} group {g} position {p}: {got} != {want}"

    def teardown(self):
        if not hasattr(self, "control"):
            return
        for seq in list(self.seqs):
            self.control.seq_rm(seq)
        for g in range(self.cfg.num_groups):
            assert self.control.num_free_pages(g) == self.cfg.num_pages - 1, "pages leaked"
            assert not self.control.refcounts(g).any()


KVControlMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_kv_control_machine = KVControlMachine.TestCase


# ---- targeted cases --------------------------------------------------------


def decode(control: BatchControl, device: Device, seq: int, num_tokens: int, per_step: int = 1) -> list[int]:
    """Write num_tokens to seq, per_step at a time, committing each step; returns tags."""
    tags = []
    while num_tokens:
        q = min(per_step, num_tokens)
        assert control.declare_step([seq] * q)
        tags += device.run(control.prepare_step(), control)
        control.commit_step()
        num_tokens -= q
    return tags


def read_back(control: BatchControl, device: Device, seq: int, group: int, positions) -> list[int]:
    return [device.read(control, group, seq, p) for p in positions]


def test_ring_sequence_longer_than_several_windows():
    cfg = make_config(windows=(0, 8), max_write=4, num_pages=40)
    control, device = BatchControl(cfg), Device(cfg)
    seq = control.seq_new()
    ring_rows = cfg.group_ring_rows(1)  # 8 + 4 - 1 = 11
    tags = decode(control, device, seq, 50, per_step=3)
    assert control.pos(seq) == control.high_water(seq) == 50
    assert read_back(control, device, seq, 0, range(50)) == tags
    assert read_back(control, device, seq, 1, range(50 - ring_rows, 50)) == tags[-ring_rows:]
    # The ring never grows past its pages, however long the sequence gets.
    assert control.pages_in_use(1) == cfg.group_pages_per_seq(1) == 3
    assert control.pages_in_use(0) == 50 // 4 + 1
    check_pages(control)


def test_rewind_at_and_below_ring_floor():
    cfg = make_config(windows=(8,), max_write=4)
    control, device = BatchControl(cfg), Device(cfg)
    seq = control.seq_new()
    decode(control, device, seq, 30, per_step=4)
    hw, ring_rows, window = 30, 11, 8
    floor = hw - ring_rows + window - 1  # smallest new_len with new_len - W + 1 >= hw - R
    assert floor == 26
    before = snapshot(control)
    assert control.rewind(seq, floor - 1) is False
    assert_same(before, snapshot(control))
    assert control.rewind(seq, floor) is True
    assert control.pos(seq) == floor and control.high_water(seq) == hw
    # Still at the floor: no further rewind except all the way to zero.
    assert control.rewind(seq, floor - 1) is False
    assert control.rewind(seq, 0) is True
    assert control.high_water(seq) == 0 and control.pages_in_use(0) == 0
    check_pages(control)


def test_rewind_flat_frees_pages_beyond_new_len():
    cfg = make_config(windows=(0,))
    control, device = BatchControl(cfg), Device(cfg)
    seq = control.seq_new()
    tags = decode(control, device, seq, 21, per_step=8)
    assert control.pages_in_use(0) == 6
    assert control.rewind(seq, 9)
    assert control.pages_in_use(0) == 3
    more = decode(control, device, seq, 5, per_step=5)
    assert read_back(control, device, seq, 0, range(14)) == tags[:9] + more
    check_pages(control)


def test_clone_of_wrapped_ring_diverges_without_leaking():
    cfg = make_config(windows=(0, 8), max_write=4)
    control, device = BatchControl(cfg), Device(cfg)
    a = control.seq_new()
    shared = decode(control, device, a, 37, per_step=3)  # ring of 11 rows wrapped 3 times
    b = control.seq_clone(a)
    assert control.high_water(b) == 37 and control.pos(b) == 37
    tail_a = decode(control, device, a, 9, per_step=2)
    tail_b = decode(control, device, b, 13, per_step=4)
    full_a, full_b = shared + tail_a, shared + tail_b
    assert read_back(control, device, a, 0, range(46)) == full_a
    assert read_back(control, device, b, 0, range(50)) == full_b
    assert read_back(control, device, a, 1, range(46 - 11, 46)) == full_a[-11:]
    assert read_back(control, device, b, 1, range(50 - 11, 50)) == full_b[-11:]
    control.seq_rm(a)
    control.seq_rm(b)
    check_pages(control)
    assert control.pages_in_use(0) == control.pages_in_use(1) == 0


def test_clone_shares_pages_and_copies_only_partial_page():
    cfg = make_config(windows=(0,), page_size=4)
    control, device = BatchControl(cfg), Device(cfg)
    a = control.seq_new()
    prompt = decode(control, device, a, 10, per_step=8)  # pages 0, 1 full, page 2 holds 2 rows
    assert control.pages_in_use(0) == 3
    b = control.seq_clone(a)
    assert control.pages_in_use(0) == 3  # shared, nothing copied yet
    assert (control.refcounts(0)[control.page_table(0)[a, :3]] == 2).all()
    assert control.declare_step([b])
    meta = control.prepare_step()
    # Only the partial last page is copied; the full pages stay shared.
    assert meta.copies[0].tolist() == [[control.page_table(0)[a, 2], control.page_table(0)[b, 2]]]
    tag_b = device.run(meta, control)
    control.commit_step()
    assert control.pages_in_use(0) == 4
    np.testing.assert_array_equal(control.page_table(0)[a, :2], control.page_table(0)[b, :2])
    tag_a = decode(control, device, a, 1)
    assert control.pages_in_use(0) == 4  # a's page 2 is its own again: written in place
    assert read_back(control, device, a, 0, range(11)) == prompt + tag_a
    assert read_back(control, device, b, 0, range(11)) == prompt + tag_b
    # A clone up to a page boundary shares only full pages and grows a fresh one.
    c = control.seq_clone(a, upto=8)
    assert control.declare_step([c])
    assert control.prepare_step().copies[0].shape == (0, 2)
    control.commit_step()
    check_pages(control)


def test_refused_declare_changes_nothing():
    cfg = make_config(windows=(0, 8), num_pages=6, max_write=8)  # 5 usable pages per group
    control, device = BatchControl(cfg), Device(cfg)
    a, b = control.seq_new(), control.seq_new()
    decode(control, device, a, 16, per_step=8)  # flat: 4 pages; ring: 15 rows -> 4 pages
    assert control.declare_step([b] * 4) is True  # ring group needs 1 page, 1 left
    control.abort_step()
    before = snapshot(control)
    assert control.declare_step([a] * 2 + [b] * 6) is False  # flat needs 1 + 2 pages
    assert_same(before, snapshot(control))
    assert not control.has_pending_step
    assert control.can_admit(4) and not control.can_admit(5)
    # Passing capacity is a refusal too.
    small = BatchControl(make_config(capacity=3, max_write=4, windows=(0,)))
    s = small.seq_new()
    before = snapshot(small)
    assert small.declare_step([s] * 4) is False
    assert_same(before, snapshot(small))


def test_abort_restores_state_and_keeps_ring_high_water():
    cfg = make_config(windows=(0, 8), max_write=8)
    control, device = BatchControl(cfg), Device(cfg)
    a = control.seq_new()
    tags = decode(control, device, a, 10, per_step=4)
    b = control.seq_clone(a)
    before = snapshot(control)
    assert control.declare_step([a] * 4 + [b] * 3)
    device.run(control.prepare_step(8), control)  # the device ran, then the step failed
    control.abort_step()
    after = snapshot(control)
    hw = {s: v[1] for s, v in after[3].items()}
    assert hw == {a: 14, b: 13}
    assert_same(before[:3], after[:3])
    for seq in (a, b):
        for g in (0, 1):
            assert read_back(control, device, seq, g, range(10)) == tags
    check_pages(control)


def test_redeclare_aborts_pending_step():
    cfg = make_config(windows=(0,))
    control = BatchControl(cfg)
    a = control.seq_new()
    assert control.declare_step([a] * 5)
    assert control.pages_in_use(0) == 2
    assert control.declare_step([a])
    assert control.pages_in_use(0) == 1
    control.commit_step()
    assert control.pos(a) == 1


def test_misuse_raises_with_value():
    cfg = make_config(windows=(0, 8), max_write=4, max_seqs=2)
    control, device = BatchControl(cfg), Device(cfg)
    a = control.seq_new()
    decode(control, device, a, 3, per_step=3)
    with pytest.raises(ValueError, match="7"):
        control.seq_rm(7)
    with pytest.raises(ValueError, match="1"):
        control.pos(1)  # never created
    with pytest.raises(ValueError, match="-1"):
        control.rewind(a, -1)
    with pytest.raises(ValueError, match="pos=3"):
        control.rewind(a, 4)
    with pytest.raises(ValueError, match="upto = 5"):
        control.seq_clone(a, upto=5)
    with pytest.raises(ValueError, match="9"):
        control.seq_clone(9)
    with pytest.raises(ValueError, match="empty"):
        control.declare_step([])
    with pytest.raises(ValueError, match="max_write = 4"):
        control.declare_step([a] * 5)
    b = control.seq_new()
    with pytest.raises(ValueError, match="contiguous"):
        control.declare_step([a, b, a])
    with pytest.raises(ValueError, match="unknown sequence id 3"):
        control.declare_step([a, 3])
    with pytest.raises(ValueError, match="no step declared"):
        control.prepare_step()
    with pytest.raises(ValueError, match="no step declared"):
        control.commit_step()
    assert control.declare_step([a, a, b])
    with pytest.raises(ValueError, match="width = 2"):
        control.prepare_step(width=2)
    with pytest.raises(ValueError, match="num_segments = 1"):
        control.prepare_step(num_segments=1)
    with pytest.raises(ValueError, match="pending step"):
        control.seq_rm(a)
    with pytest.raises(ValueError, match="num_tokens = -1"):
        control.can_admit(-1)
    assert control.seq_new() is None  # refusal, not misuse
    control.abort_step()


def test_per_sequence_write_limit_shrinks_the_ring_and_is_enforced():
    window, max_write, max_seq_write = 8, 16, 4
    cfg = make_config(windows=(0, window), max_write=max_write, max_seq_write=max_seq_write, max_seqs=3)
    assert cfg.group_ring_rows(1) == window + max_seq_write - 1 < make_config(
        windows=(0, window), max_write=max_write).group_ring_rows(1) == window + max_write - 1
    control = BatchControl(cfg)
    a, b, c = control.seq_new(), control.seq_new(), control.seq_new()
    with pytest.raises(ValueError, match=rf"sequence {b} writes {max_seq_write + 1} tokens, more than "
                                         rf"max_seq_write = {max_seq_write}"):
        control.declare_step([a] * max_seq_write + [b] * (max_seq_write + 1))
    assert control.declare_step([a] * max_seq_write + [b] * max_seq_write + [c] * max_seq_write)  # the step may
    control.abort_step()  # still be wider than one sequence's limit
    with pytest.raises(ValueError, match=rf"max_seq_write = {max_write + 1!r}, must be an int in \[1, max_write"):
        make_config(max_write=max_write, max_seq_write=max_write + 1)


# ---- prefix caching --------------------------------------------------------


def test_page_keys_differ_when_any_token_of_the_prefix_differs():
    rng = np.random.default_rng(0)
    size = 4
    tokens = rng.integers(0, 1000, 40).tolist()
    keys = page_keys(tokens, size, SALT)
    assert len(keys) == 10 and len(set(keys)) == 10
    assert page_keys(tokens[:23], size, SALT) == keys[:5]  # a partial page has no key
    assert page_keys(tokens, size, keys[3], start=4) == keys[4:]  # chained from page 3's key
    for i in rng.choice(40, 8, replace=False).tolist():
        changed = tokens[:i] + [tokens[i] + 1] + tokens[i + 1:]
        other = page_keys(changed, size, SALT)
        first = i // size
        assert other[:first] == keys[:first]
        assert all(a != b for a, b in zip(other[first:], keys[first:])), f"token {i} changed, a later key did not"
    assert page_keys(tokens, size, salt("another model")) != keys


def prefill(control, device, tokens, per_step=4):
    """A new sequence over `tokens`, prefilled and cached; returns (seq, its tags)."""
    seq = control.seq_new()
    tags = decode(control, device, seq, len(tokens), per_step)
    control.cache_pages(seq, page_keys(tokens, control.config.page_size, SALT))
    return seq, tags


def test_prefix_cache_maps_full_pages_and_leaves_the_rest():
    cfg = make_config(windows=(0,), max_write=8)
    control, device = BatchControl(cfg), Device(cfg)
    tokens = list(range(1, 15))  # 3 full pages of 4 and 2 tokens
    a, tags = prefill(control, device, tokens)
    assert control.num_cached_pages(0) == 3 and not control.evictable_pages(0)
    b = control.seq_new(page_keys(tokens[:10] + [99, 98, 97], 4, SALT))  # shares 2 full pages, then differs
    assert control.pos(b) == 8
    assert read_back(control, device, b, 0, range(8)) == tags[:8]
    assert control.refcounts(0)[control.page_table(0)[a, :2]].tolist() == [2, 2]
    more = decode(control, device, b, 5)  # writes a page of its own: nothing shared is written
    assert read_back(control, device, a, 0, range(14)) == tags
    assert read_back(control, device, b, 0, range(13)) == tags[:8] + more
    control.seq_rm(a)
    control.seq_rm(b)
    assert control.num_free_pages(0) == cfg.num_pages - 1 and control.num_cached_pages(0) == 3
    check_pages(control)


def test_cached_pages_are_evicted_least_recently_released_first_and_only_when_free_pages_run_out():
    cfg = make_config(windows=(0,), num_pages=9, max_write=8)  # 8 usable pages
    control, device = BatchControl(cfg), Device(cfg)
    a, _ = prefill(control, device, list(range(100, 112)))  # 3 pages
    b, _ = prefill(control, device, list(range(200, 212)))  # 3 pages
    pages_a, pages_b = control.page_table(0)[a, :3].tolist(), control.page_table(0)[b, :3].tolist()
    control.seq_rm(a)
    control.seq_rm(b)
    assert control.evictable_pages(0) == pages_a[::-1] + pages_b[::-1]  # a's tail goes first
    c = control.seq_new()
    decode(control, device, c, 12)  # 3 pages: the 2 free ones, then a's last page
    assert control.evictions == 1 and control.evictable_pages(0) == pages_a[1::-1] + pages_b[::-1]
    d = control.seq_new(page_keys(list(range(100, 112)), 4, SALT))
    assert control.pos(d) == 8  # a's first two pages survived
    e = control.seq_new(page_keys(list(range(200, 212)), 4, SALT))
    assert control.pos(e) == 12
    check_pages(control)


def test_ring_groups_reuse_only_a_first_lap_prefix():
    cfg = make_config(windows=(0, 8), max_write=4, capacity=64)  # ring rows 8 + 4 - 1 = 11: 2 whole pages
    control, device = BatchControl(cfg), Device(cfg)
    short = list(range(1, 11))
    a, tags = prefill(control, device, short)  # never wraps: the ring caches its whole pages 0 and 1
    assert control.num_cached_pages(1) == 2 and control.num_cached_pages(0) == 2
    b = control.seq_new(page_keys(short, 4, SALT))
    assert control.pos(b) == 8  # page 2 would be past the first lap
    for g in range(2):
        assert read_back(control, device, b, g, range(8)) == tags[:8]
    control.seq_rm(b)
    long = list(range(20, 40))
    c, _ = prefill(control, device, long)  # wrapped before it was cached: its ring pages are not
    assert control.num_cached_pages(0) == 2 + 5 and control.num_cached_pages(1) == 2
    d = control.seq_new(page_keys(long, 4, SALT))
    assert control.pos(d) == 0  # the flat group alone could reuse 5 pages, but a step computes every layer
    check_pages(control)


def test_writing_into_a_cached_page_uncaches_or_copies_it():
    cfg = make_config(windows=(0,), max_write=8)
    control, device = BatchControl(cfg), Device(cfg)
    tokens = list(range(1, 13))
    a, tags = prefill(control, device, tokens)
    assert control.rewind(a, 6)  # into page 1, cached, owned by a alone: written in place, so uncached
    decode(control, device, a, 1)
    assert control.num_cached_pages(0) == 2 and control.page_table(0)[a, 1] not in control.cached_pages(0)
    b = control.seq_new(page_keys(tokens, 4, SALT))
    assert control.pos(b) == 4
    assert control.rewind(b, 2)  # into page 0, shared with a: copied, the cached page stays
    decode(control, device, b, 1)
    assert control.page_table(0)[b, 0] != control.page_table(0)[a, 0] in control.cached_pages(0)
    assert read_back(control, device, a, 0, range(4)) == tags[:4]
    check_pages(control)


def test_a_step_carries_the_table_entries_set_since_the_last_one():
    """The device keeps its own page tables: a prepared step carries each entry set since the last committed step
    once (its latest page), an aborted copy names the old page again, and take_table_changes hands them over."""
    cfg = make_config(windows=(0,), page_size=4)
    control, device = BatchControl(cfg), Device(cfg)
    a = control.seq_new()
    assert control.declare_step([a] * 6)  # pages 0 and 1
    meta = control.prepare_step()
    table = control.page_table(0)
    assert meta.table_changes[0].tolist() == [[a, 0, table[a, 0]], [a, 1, table[a, 1]]]
    device.run(meta, control)
    control.commit_step()
    assert control.table_changes()[0].shape == (0, 3)  # sent with the committed step
    b = control.seq_clone(a)  # shares both pages: two entries for b, not yet sent
    assert control.declare_step([b])  # copies b's partial page 1
    copied = control.page_table(0)[b, 1]
    assert copied != control.page_table(0)[a, 1]
    meta = control.prepare_step()
    assert meta.table_changes[0].tolist() == [[b, 0, table[a, 0]], [b, 1, copied]]  # the latest page of (b, 1)
    device.run(meta, control)  # the device ran it (b's entry names the copy), then the step failed
    control.abort_step()
    assert control.table_changes()[0].tolist() == [[b, 0, table[a, 0]], [b, 1, table[a, 1]]]
    assert control.declare_step([a])
    device.run(control.prepare_step(), control)  # Device.run checks its tables against the host's
    control.commit_step()
    c = control.seq_new()
    assert control.declare_step([c])
    control.prepare_step()
    d = control.seq_clone(b)  # set after the step was prepared: still to send after its commit
    control.commit_step()
    assert [r[0] for r in control.table_changes()[0].tolist()] == [d, d]
    taken = control.take_table_changes()
    assert [r[0] for r in taken[0].tolist()] == [d, d] and control.table_changes()[0].shape == (0, 3)
