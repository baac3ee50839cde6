"""The engine's device programs, whoever built them: the live model (jit) or an exported artifact.

A `ProgramSet` is a table of named programs, each a jitted function with the abstract arguments it is
compiled for: `forward_{W}` for every step width W, `sample` (top-k / top-p draws), `logprobs`,
`copy` (copy-on-write pages) and `tables` (page-table entries past what a step's upload carries). Each
compiles once: `compile_all` lowers them one by one (decode widths first) and compiles in parallel threads;
a program not yet compiled compiles on first use.

Arguments cross the program boundary as plain tuples and a flat `{"dotted.name": array}` parameter dict,
so the exported signatures need no custom pytree types. No glint.model import: an engine served from an
artifact runs on this module alone.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from glint.kvcache import CacheConfig, KVState, StepMetadata
from glint.pallas_kernels.reference import scale_pool_shape
from glint.runtime import executables
from glint.runtime.sampling import BIAS_WIDTH, SAMPLER_COLUMNS, history_widths

COPY_ROWS = 64  # page copies per `copy` call; a step needing more runs it again
TABLE_ROWS = 1024  # page-table entries per `tables` call (per group)
# Arguments a program donates (the KV state and the page tables), so XLA updates them in place: the live jit and
# the exported call.
FORWARD_DONATE_ARGNUMS, DRAFT_DONATE_ARGNUMS, COPY_DONATE_ARGNUMS, TABLES_DONATE_ARGNUMS = (1, 2), (1,), (0,), (0,)
RUNTIME_PROGRAMS = ("sample", "logprobs", "copy", "tables")  # what an engine runs besides its forwards and penalize_H
START_PROGRAMS = ("kv_init",)  # run once, when an engine starts


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DeviceMeta:
    """The int32 metadata of one step: on the host, what the step uploads (`table_changes`, no tables); inside
    the program, what the layers read (`page_tables`: the device's tables with the changes applied)."""

    positions: jax.Array  # i32[W]
    slots: tuple[jax.Array, ...]  # per layer group, i32[W]
    seq_info: jax.Array  # i32[S, 4]; column 2: the sequence id, its row of the page tables
    page_tables: tuple[jax.Array, ...] = ()  # per layer group, i32[max_seqs, P_g] (inside the program)
    table_changes: tuple[jax.Array, ...] = ()  # per layer group, i32[n, 3] (seq, index, page) (on the host)

    @classmethod
    def from_host(cls, meta: StepMetadata) -> DeviceMeta:
        return cls(meta.positions, tuple(meta.slots), meta.seq_info, table_changes=tuple(meta.table_changes))


def apply_table_changes(tables: tuple, changes: tuple) -> tuple:
    """Per group, the page table i32[max_seqs, P] with the changes i32[n, 3] (seq, index, page) set; pad rows name
    a sequence past the table (dropped). Each (seq, index) appears at most once (the host dedupes)."""
    return tuple(jnp.asarray(t).at[c[:, 0], c[:, 1]].set(c[:, 2], mode="drop") for t, c in zip(tables, changes))


# Every array of the upload starts at a multiple of 256 bytes: XLA hands a kernel its slice in place, and a Mosaic
# GPU kernel under a command buffer refuses an input that is not 256-byte aligned (the H200 bench failed so on the
# page table at some widths: "Input buffer 2 is not 256-byte aligned").
SPAN_ALIGN = 256 // 4  # int32 elements


@dataclass(frozen=True)
class StepLayout:
    """Where a step's host inputs sit in its one int32 upload: `pack` (NumPy, the host) concatenates them in a
    fixed order, `unpack` (inside the program) slices them out again. The layout is fixed per step width, so a
    step costs one host-to-device copy instead of a dozen; floats and uint32 seeds travel as their bits.

    Per token row (width W): tokens, token_src, positions, slots [G, W]; per segment (S): seq_info [S, 4]; per
    layer group, up to `changes` page-table entries set since the last step, table_changes_g [changes, 3]
    (seq, index, page; pads name sequence `max_seqs`, past the table); per sampled row (R): rows, draft_rows (the
    DFlash drafting program's output rows), then the sampler's columns (`sampling.SAMPLER_COLUMNS`).
    """

    width: int
    segments: int
    rows: int
    groups: int  # layer groups (each its page table)
    changes: int  # page-table entries per group the upload carries (`Runner.forward` sends more separately)
    max_seqs: int  # a pad change names this sequence (out of the tables: dropped)

    @classmethod
    def of(cls, width: int, cache: CacheConfig, max_seqs: int, rows: int) -> StepLayout:
        segments = num_segments(width, max_seqs)
        return cls(width, segments, rows, cache.num_groups, step_changes(width, segments, cache.page_size), max_seqs)

    @property
    def parts(self) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
        w, s, r = self.width, self.segments, self.rows
        i32 = np.dtype(np.int32)
        return (("tokens", (w,), i32), ("token_src", (w,), i32), ("positions", (w,), i32),
                ("slots", (self.groups, w), i32), ("seq_info", (s, 4), i32),
                *((f"table_changes_{g}", (self.changes, 3), i32) for g in range(self.groups)),
                ("rows", (r,), i32), ("draft_rows", (r,), i32),
                *((name, (r,), np.dtype(dtype)) for name, dtype in SAMPLER_COLUMNS))

    @functools.cached_property
    def spans(self) -> tuple[tuple[str, int, int, tuple[int, ...], np.dtype], ...]:
        """(name, start, stop, shape, dtype) of every array `pack` writes and `unpack` reads, the slots one per
        layer group."""
        spans, start = [], 0
        for name, shape, dtype in self.parts:
            pieces = [(f"slots[{g}]", shape[1:]) for g in range(shape[0])] if name == "slots" else [(name, shape)]
            for piece, piece_shape in pieces:
                n = int(np.prod(piece_shape))
                start = -(-start // SPAN_ALIGN) * SPAN_ALIGN
                spans.append((piece, start, start + n, piece_shape, dtype))
                start += n
        return tuple(spans)

    @property
    def size(self) -> int:
        return self.spans[-1][2]

    def pack(self, tokens, token_src, meta: DeviceMeta, rows, sampler=None, draft_rows=None) -> np.ndarray:
        """The host arrays of one step as one i32[size] (a missing sampler or draft_rows: zeros); each group's
        table changes (at most `changes`) padded with entries past the tables."""
        fields = (None,) * len(SAMPLER_COLUMNS) if sampler is None else sampler.columns()
        if len(meta.slots) != self.groups or len(meta.table_changes) != self.groups:
            raise ValueError(f"step inputs for {len(meta.slots)} slot and {len(meta.table_changes)} table-change "
                             f"groups; the width-{self.width} layout holds {self.groups}")
        changes = []
        for c in meta.table_changes:
            c = np.asarray(c, np.int32).reshape(-1, 3)
            if len(c) > self.changes:
                raise ValueError(f"{len(c)} page-table changes; the width-{self.width} upload holds {self.changes} "
                                 "(Runner.forward sends the rest first)")
            changes.append(_padded(c, self.changes, (self.max_seqs, 0, 0)))
        values = (tokens, token_src, meta.positions, *meta.slots, meta.seq_info, *changes, rows, draft_rows, *fields)
        out = np.zeros(self.size, np.int32)
        for (name, start, stop, shape, dtype), value in zip(self.spans, values):
            if value is None:
                continue
            value = np.asarray(value, dtype)
            if value.shape != shape:
                raise ValueError(f"step input {name}: shape {value.shape}, the width-{self.width} layout holds {shape}")
            out[start:stop] = value.reshape(-1).view(np.int32)
        return out

    def unpack(self, host) -> dict[str, jax.Array]:
        """The named arrays of `pack`'s output, back in their shapes and dtypes (inside a program)."""
        out = {}
        for name, start, stop, shape, dtype in self.spans:
            part = host[start:stop].reshape(shape)
            out[name] = part if dtype == np.int32 else jax.lax.bitcast_convert_type(part, dtype)
        return out

    def meta(self, parts: dict[str, jax.Array], tables: tuple) -> DeviceMeta:
        """The step's metadata inside the program; `tables`: the device's page tables, this step's changes
        applied (`apply_table_changes` with `table_changes(parts)`)."""
        groups = range(self.groups)
        return DeviceMeta(parts["positions"], tuple(parts[f"slots[{g}]"] for g in groups), parts["seq_info"],
                          tuple(tables))

    def table_changes(self, parts: dict[str, jax.Array]) -> tuple:
        return tuple(parts[f"table_changes_{g}"] for g in range(self.groups))

    def sampler(self, parts: dict[str, jax.Array]) -> tuple:
        return tuple(parts[name] for name, _ in SAMPLER_COLUMNS)


def forward_name(width: int) -> str:
    return f"forward_{width}"


def draft_name(width: int) -> str:
    return f"draft_{width}"


def penalize_name(history_width: int) -> str:
    return f"penalize_{history_width}"


def penalize_names(capacity: int) -> list[str]:
    """The penalize programs an engine of this context capacity runs: one per history width."""
    return [penalize_name(w) for w in history_widths(capacity)]


def donate_argnums(name: str) -> tuple[int, ...]:
    if name.startswith("forward_"):
        return FORWARD_DONATE_ARGNUMS
    if name.startswith("draft_"):
        return DRAFT_DONATE_ARGNUMS  # the pools; it reads the tables
    return {"copy": COPY_DONATE_ARGNUMS, "tables": TABLES_DONATE_ARGNUMS}.get(name, ())


def _padded(rows: np.ndarray, length: int, pad_row: tuple[int, ...]) -> np.ndarray:
    """i32[length, len(pad_row)]: `rows` (at most `length` of them), then `pad_row` repeated."""
    out = np.empty((length, len(pad_row)), np.int32)
    out[:] = pad_row
    out[:len(rows)] = rows
    return out


def _chunks(groups, size: int, pad_row: tuple[int, ...]):
    """Per layer group rows i32[n_g, len(pad_row)] -> tuples of `size` rows per group, padded with `pad_row`,
    as many as the longest group needs."""
    groups = [np.asarray(c, np.int32).reshape(-1, len(pad_row)) for c in groups]
    for start in range(0, max((len(c) for c in groups), default=0), size):
        yield tuple(_padded(c[start:start + size], size, pad_row) for c in groups)


def num_segments(width: int, max_seqs: int) -> int:
    """Segments a step of `width` tokens can hold: one per sequence, at most one per token."""
    return min(width, max_seqs)


def step_changes(width: int, segments: int, page_size: int) -> int:
    """Page-table entries per group a width-`width` upload carries: the most a step's own growth can set (a
    sequence's run of n tokens touches at most n // page_size + 2 pages; one page per token at most). Prefix
    hits, clones and aborted copies can set more between two steps: `Runner.forward` sends those separately."""
    return max(1, min(width, width // page_size + 2 * segments))


def kv_sharding(cache: CacheConfig, mesh: jax.sharding.Mesh) -> tuple[jax.sharding.NamedSharding, ...]:
    """Per part of KVState.parts(), how its pools lie over a tensor-parallel mesh: split by KV head (k and v
    [num_pages, page_size, kv_heads, head_dim]; a scaled cache's k_scale and v_scale [num_pages, kv_heads,
    page_size])."""
    P = jax.sharding.PartitionSpec
    pools = jax.sharding.NamedSharding(mesh, P(None, None, mesh.axis_names[0], None))
    scales = jax.sharding.NamedSharding(mesh, P(None, mesh.axis_names[0], None))
    return (pools, pools, scales, scales) if cache.scaled else (pools, pools)


def abstract_args(name: str, params: dict, cache: CacheConfig, max_seqs: int, rows: int, vocab_size: int,
                  mesh: jax.sharding.Mesh | None = None) -> tuple:
    """The abstract arguments program `name` is compiled for (params: flat dict of arrays or specs).

    With a tensor-parallel `mesh` every argument carries its sharding: the KV pools split by KV head
    (`kv_sharding`), the parameters their own (model/tp.py), the rest replicated.

    forward_W: (params, kv, tables, host i32[N], prev_tokens i32[R]) -> (tokens, logits, kv, tables); kv:
               KVState.parts(), (k, v) or in a scaled cache (k, v, k_scale, v_scale); tables: per layer group
               the page table i32[max_seqs, P_g]; host: the step's inputs packed by `StepLayout.of(W, ...)`:
               tokens, token_src, the metadata (positions, slots, seq_info, page-table changes), the sampled
               rows and the sampler (`sampling.SAMPLER_COLUMNS`)
    sample:    (logits f32[R, V], sampler tuple)
    penalize_H: (logits f32[R, V], penalties (history i32[R, H], prompt_len i32[R], presence, frequency,
               repetition f32[R], bias_ids i32[R, BIAS_WIDTH], bias f32[R, BIAS_WIDTH], allowed bool[R, BIAS_WIDTH],
               restricted bool[R]), prev_tokens i32[R],
               sampler tuple) -> (logits f32[R, V] biased and penalized, tokens i32[R] drawn from them without
               top-k/top-p) (sampling.PenaltyInputs, sampling.penalize)
    sample_argmax: (logits f32[R, V],)
    logprobs:  (logits f32[R, V], tokens i32[R])
    draft_W:   (params, kv, tables, host i32[N]): the same layout, its draft_rows the output rows
    copy:      (kv, per group i32[COPY_ROWS, 2])
    tables:    (tables, per group i32[TABLE_ROWS, 3] (seq, index, page)) -> tables
    kv_init:   () -> (kv, tables): the zeroed pools and page tables
    """
    replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def _spec(shape, dtype, sharding=replicated) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)

    i32 = lambda *shape: _spec(shape, np.int32)  # noqa: E731
    placed = (None,) * 4 if mesh is None else kv_sharding(cache, mesh)
    pages = [(cache.num_pages, cache.page_size, cache.kv_heads[l]) for l in range(cache.num_layers)]
    kv = tuple(tuple(_spec((*shape, cache.head_dim[l]), cache.dtype, placed[part]) for l, shape in enumerate(pages))
               for part in range(2))
    if cache.scaled:
        kv += tuple(tuple(_spec(scale_pool_shape(*shape), np.float32, placed[part]) for shape in pages)
                    for part in (2, 3))
    sampler = tuple(_spec((rows,), dtype) for _, dtype in SAMPLER_COLUMNS)
    logits = _spec((rows, vocab_size), np.float32)
    if name == "sample":
        return logits, sampler
    if name == "sample_argmax":
        return (logits,)
    if name.startswith("penalize_"):
        strengths = (_spec((rows,), np.float32),) * 3  # presence, frequency, repetition
        biases = i32(rows, BIAS_WIDTH), _spec((rows, BIAS_WIDTH), np.float32), _spec((rows, BIAS_WIDTH), bool), \
            _spec((rows,), bool)
        history = i32(rows, int(name.removeprefix("penalize_")))
        return logits, (history, i32(rows), *strengths, *biases), i32(rows), sampler
    if name == "logprobs":
        return logits, i32(rows)
    tables = tuple(i32(max_seqs, cache.group_pages_per_seq(g)) for g in range(cache.num_groups))
    if name == "copy":
        return kv, tuple(i32(COPY_ROWS, 2) for _ in range(cache.num_groups))
    if name == "tables":
        return tables, tuple(i32(TABLE_ROWS, 3) for _ in range(cache.num_groups))
    if name == "kv_init":
        return ()
    kind, width = name.rsplit("_", 1)
    host = i32(StepLayout.of(int(width), cache, max_seqs, rows).size)
    params = {k: _spec(v.shape, v.dtype, None if mesh is None else v.sharding) for k, v in params.items()}
    if kind == "draft":
        return params, kv, tables, host
    return params, kv, tables, host, i32(rows)


@dataclass
class Program:
    fn: Callable  # a jax.jit-wrapped function
    args: tuple  # abstract arguments (ShapeDtypeStruct pytree)


class ProgramSet:
    """Named programs, each compiled once and then called directly (no retracing, no cache lookups)."""

    def __init__(self, programs: dict[str, Program], compiled: dict[str, jax.stages.Compiled] | None = None,
                 identity: str | None = None):
        """`identity`: what, besides the name, determines each program (model, geometry, kernels); given, the
        executables are also kept between processes (`glint.runtime.executables`)."""
        self.programs, self.identity = programs, identity
        self._compiled = dict(compiled or {})
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> jax.stages.Compiled:
        compiled = self._compiled.get(name)
        if compiled is None:
            with self._lock:
                if name not in self._compiled:
                    self._compiled[name] = self._cached(name) or self._finish(name, self.lower(name).compile())
                compiled = self._compiled[name]
        return compiled

    def _cached(self, name: str) -> jax.stages.Compiled | None:
        return executables.load(self.identity, name) if self.identity is not None else None

    def _finish(self, name: str, compiled: jax.stages.Compiled) -> jax.stages.Compiled:
        if self.identity is not None:
            executables.store(self.identity, name, compiled)
        return compiled

    def lower(self, name: str):
        p = self.programs[name]
        return p.fn.lower(*p.args)

    def is_compiled(self, name: str) -> bool:
        return name in self._compiled

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def compile_all(self, names: Iterable[str], progress: Callable[[str, float], None] | None = None,
                    max_workers: int | None = None) -> dict[str, float]:
        """Lower `names` in order on this thread and compile them in a thread pool as they are lowered.

        Returns seconds per program (lowering + compiling); `progress(name, seconds)` is called as each is done.
        """
        todo = [n for n in names if n not in self._compiled]
        times: dict[str, float] = {}
        workers = max_workers or max(1, min(len(todo), os.cpu_count() or 1))
        t_start = time.perf_counter()

        def done(name: str, compiled: jax.stages.Compiled, t0: float) -> None:
            self._compiled[name] = compiled
            times[name] = time.perf_counter() - t0
            if progress is not None:
                progress(name, times[name])

        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="glint-compile") as pool:
            loads = {name: pool.submit(self._cached, name) for name in todo}  # kept executables, in parallel
            futures = {}
            for name in todo:
                if (cached := loads[name].result()) is not None:
                    done(name, cached, t_start)
                    continue
                t0 = time.perf_counter()
                lowered = self.lower(name)  # tracing holds the GIL: one at a time, here
                futures[pool.submit(lambda n=name, low=lowered: self._finish(n, low.compile()))] = (name, t0)
            for future in concurrent.futures.as_completed(futures):
                name, t0 = futures[future]
                done(name, future.result(), t0)
        return times


class Runner:
    """Calls a ProgramSet with the engine's objects (KVState, DeviceMeta, SamplerInputs); packs each step's host
    inputs with the layout its width's program unpacks (one StepLayout per width, made once). Holds the device's
    page tables (`tables`), which each step updates from the changes its metadata carries."""

    def __init__(self, programs: ProgramSet, cache: CacheConfig, max_seqs: int, rows: int):
        self.programs = programs
        self.tables: tuple | None = None  # per layer group i32[max_seqs, P_g], from kv_init
        self._max_seqs = max_seqs
        self._layout_of = functools.cache(lambda width: StepLayout.of(width, cache, max_seqs, rows))

    def layout(self, width: int) -> StepLayout:
        return self._layout_of(width)

    def split_changes(self, width: int, meta: DeviceMeta) -> tuple[DeviceMeta, list | None]:
        """`meta` cut to the width's upload of table changes per group, and the changes before those (None: none),
        which `update_tables` must send first. Host only."""
        keep = self.layout(width).changes
        changes = [np.asarray(c, np.int32).reshape(-1, 3) for c in meta.table_changes]
        if all(len(c) <= keep for c in changes):
            return meta, None
        return dataclasses.replace(meta, table_changes=tuple(c[-keep:] for c in changes)), [c[:-keep] for c in changes]

    def update_tables(self, changes) -> None:
        """Set page-table entries on the device: per group i32[n, 3] (seq, index, page), each (seq, index) once."""
        for chunk in _chunks(changes, TABLE_ROWS, (self._max_seqs, 0, 0)):  # pads: past the tables, dropped
            self.tables = self.programs["tables"](self.tables, chunk)

    def pack(self, width: int, tokens, token_src, meta: DeviceMeta, rows, sampler=None, draft_rows=None) -> np.ndarray:
        """A step's host inputs as the width's program takes them (`StepLayout.pack`; `meta` cut by
        `split_changes`)."""
        return self.layout(width).pack(tokens, token_src, meta, rows, sampler, draft_rows)

    def forward(self, width: int, params: dict, kv: KVState, tokens, token_src, prev_tokens, meta: DeviceMeta, rows,
                sampler) -> tuple[jax.Array, jax.Array, KVState]:
        """-> (tokens i32[R] drawn with min-p, without top-k/top-p, logits f32[R, V], kv); the tables updated in
        place (table changes past the width's upload go first, TABLE_ROWS at a time: the `tables` program)."""
        meta, earlier = self.split_changes(width, meta)
        if earlier is not None:
            self.update_tables(earlier)
        host = self.pack(width, tokens, token_src, meta, rows, sampler)
        return self.run_forward(width, params, kv, host, prev_tokens)

    def run_forward(self, width: int, params: dict, kv: KVState, host: np.ndarray, prev_tokens):
        """`forward` on a packed step."""
        next_tokens, logits, parts, self.tables = self.programs[forward_name(width)](params, kv.parts(), self.tables,
                                                                                     host, prev_tokens)
        return next_tokens, logits, KVState(*parts)

    def sample(self, logits, sampler) -> jax.Array:
        """Tokens i32[R] with every row's top-k / top-p applied."""
        return self.programs["sample"](logits, sampler.columns())

    def penalize(self, logits, penalties, prev_tokens, sampler) -> tuple[jax.Array, jax.Array]:
        """(The logits f32[R, V] with each row's logit biases and presence / frequency / repetition penalties
        applied, the tokens i32[R] drawn from them without top-k/top-p) (`sampling.PenaltyInputs`; prev_tokens: the
        previous step's output, which placeholders in it index)."""
        name = penalize_name(penalties.history.shape[1])
        return self.programs[name](logits, penalties.columns(), prev_tokens, sampler.columns())

    def run_draft(self, width: int, params: dict, kv: KVState, host: np.ndarray):
        """DFlash drafting before a verifying step, on the step packed with `draft_rows` as both its rows and its
        draft rows: (draft tokens i32[R], kv)."""
        drafted, parts = self.programs[draft_name(width)](params, kv.parts(), self.tables, host)
        return drafted, KVState(*parts)

    def logprobs(self, logits, tokens):
        """(chosen f32[R], top f32[R, k], top_ids i32[R, k])."""
        return self.programs["logprobs"](logits, tokens)

    def kv_init(self) -> KVState:
        """The zeroed pools; the page tables zeroed too (kept here)."""
        parts, self.tables = self.programs["kv_init"]()
        return KVState(*parts)

    def copy(self, kv: KVState, copies: tuple[np.ndarray, ...]) -> KVState:
        """Apply per-group (src, dst) page copies, COPY_ROWS at a time; pads (0, 0) copy scratch onto itself.

        Chunks may run one after another: a destination is a page just taken from the free list, never the
        source of another copy of the same step.
        """
        state = kv.parts()
        for chunk in _chunks(copies, COPY_ROWS, (0, 0)):
            state = self.programs["copy"](state, chunk)
        return KVState(*state)
