"""Cache geometry: a frozen, self-checking description of the paged KV pools.

No jax import: the host bookkeeping (`control.py`) and the device state
(`state.py`) both read it, and it must be usable as a static jit argument.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Bytes per element of the dtypes a KV pool may hold (names as jnp spells them).
DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

# Pools of these dtypes carry a float32 scale per row and head beside them (a scaled fp8 cache, state.py).
SCALED_DTYPES = ("float8_e4m3fn",)
SCALE_BYTES = 4

# Slots are int32 `page * page_size + offset`, so the pool must stay addressable.
MAX_SLOTS = 2**31 - 1


def _per_layer(name: str, value: int | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    if isinstance(value, int):
        values = (value,) * num_layers
    else:
        values = tuple(value)
    if len(values) != num_layers:
        raise ValueError(f"{name} has {len(values)} entries, expected one per layer ({num_layers})")
    for layer, v in enumerate(values):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}[{layer}] = {v!r}, must be an int >= 1")
    return values


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Geometry of the paged KV cache.

    Args:
      page_size: rows per page.
      num_pages: pages per layer pool, counting the scratch page 0 (usable pages
        are 1..num_pages-1).
      max_seqs: concurrent sequences (ids and page-table rows 0..max_seqs-1).
      max_write: most tokens one step writes (all sequences together).
      max_seq_write: most tokens one sequence writes in one step (default max_write); ring
        layers hold window + max_seq_write - 1 rows per sequence.
      capacity: most positions one sequence may hold.
      windows: per layer, 0 for full attention (flat), W > 0 for a sliding window
        of W keys (ring storage).
      kv_heads, head_dim: an int for all layers or one per layer.
      dtype: element type of the pools, e.g. "bfloat16"; "float8_e4m3fn" pools carry a float32 scale per
        row and head (`scaled`).

    Layers that share a window share one page table: they form a *group*.
    """

    page_size: int
    num_pages: int
    max_seqs: int
    max_write: int
    capacity: int
    windows: tuple[int, ...]
    kv_heads: int | tuple[int, ...]
    head_dim: int | tuple[int, ...]
    dtype: str = "bfloat16"
    max_seq_write: int | None = None
    # Derived in __post_init__.
    group_windows: tuple[int, ...] = dataclasses.field(init=False)
    layer_group: tuple[int, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        for name in ("page_size", "max_seqs", "max_write", "capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}, must be an int >= 1")
        if self.max_seq_write is None:
            object.__setattr__(self, "max_seq_write", self.max_write)
        if not isinstance(self.max_seq_write, int) or not 1 <= self.max_seq_write <= self.max_write:
            raise ValueError(f"max_seq_write = {self.max_seq_write!r}, must be an int in [1, max_write = "
                             f"{self.max_write}]")
        if not isinstance(self.num_pages, int) or self.num_pages < 2:
            raise ValueError(f"num_pages = {self.num_pages!r}, must be an int >= 2 (scratch page 0 + 1)")
        if self.num_pages * self.page_size > MAX_SLOTS:
            raise ValueError(
                f"num_pages * page_size = {self.num_pages * self.page_size} exceeds the int32 slot limit {MAX_SLOTS}"
            )
        windows = tuple(self.windows)
        if not windows:
            raise ValueError("windows is empty, need one entry per layer")
        for layer, w in enumerate(windows):
            if not isinstance(w, int) or w < 0:
                raise ValueError(f"windows[{layer}] = {w!r}, must be an int >= 0 (0 = full attention)")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype = {self.dtype!r}, must be one of {sorted(DTYPE_BYTES)}")
        num_layers = len(windows)
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("windows", windows)
        set_("kv_heads", _per_layer("kv_heads", self.kv_heads, num_layers))
        set_("head_dim", _per_layer("head_dim", self.head_dim, num_layers))
        group_windows = tuple(sorted(set(windows)))  # 0 (flat) sorts first
        set_("group_windows", group_windows)
        set_("layer_group", tuple(group_windows.index(w) for w in windows))

    # ---- derived geometry -------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def group_layers(self, group: int) -> tuple[int, ...]:
        """Layers whose pools use `group`'s page table."""
        return tuple(layer for layer, g in enumerate(self.layer_group) if g == group)

    def is_ring(self, group: int) -> bool:
        return self.group_windows[group] > 0

    def group_ring_rows(self, group: int) -> int | None:
        """Rows a ring group stores per sequence (None for a flat group).

        The extra `max_seq_write - 1` rows keep a sequence's writes in one step
        from overwriting keys that its earlier queries of the same step still need.
        """
        window = self.group_windows[group]
        if window == 0:
            return None
        return min(self.capacity, window + self.max_seq_write - 1)

    def group_rows(self, group: int) -> int:
        """Rows a sequence may hold in `group`: capacity (flat) or ring_rows."""
        ring_rows = self.group_ring_rows(group)
        return self.capacity if ring_rows is None else ring_rows

    def group_pages_per_seq(self, group: int) -> int:
        return -(-self.group_rows(group) // self.page_size)

    # ---- memory -----------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def scaled(self) -> bool:
        """Whether every pool row carries a float32 scale per head (float8_e4m3fn pools)."""
        return self.dtype in SCALED_DTYPES

    def head_row_bytes(self, layer: int) -> int:
        """Bytes one position of one KV head of `layer` takes, for K or for V (its scale included)."""
        return self.head_dim[layer] * self.itemsize + (SCALE_BYTES if self.scaled else 0)

    def page_bytes(self, layer: int) -> int:
        """Bytes of one page of `layer`, K and V together (and their scales)."""
        return 2 * self.page_size * self.kv_heads[layer] * self.head_row_bytes(layer)

    @property
    def bytes_per_page_id(self) -> int:
        """Bytes one page id costs: every layer has its own pool of num_pages."""
        return sum(self.page_bytes(layer) for layer in range(self.num_layers))

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page_id

    @property
    def max_useful_pages(self) -> int:
        """Pages beyond this can never be in use at once (+1 for scratch)."""
        per_seq = max(self.group_pages_per_seq(g) for g in range(self.num_groups))
        return 1 + self.max_seqs * per_seq

    def num_pages_for_budget(self, budget_bytes: int) -> int:
        """Pool size (counting scratch) that fits `budget_bytes`, with this geometry.

        Ignores `self.num_pages`; capped at `max_useful_pages`, since more could
        never be in use. Raises ValueError when not even two pages fit.
        """
        num_pages = int(budget_bytes) // self.bytes_per_page_id
        if num_pages < 2:
            raise ValueError(
                f"budget of {int(budget_bytes)} bytes fits {num_pages} pages of "
                f"{self.bytes_per_page_id} bytes (all layers), need at least 2"
            )
        return min(num_pages, self.max_useful_pages, MAX_SLOTS // self.page_size)

    @classmethod
    def from_budget(cls, budget_bytes: int, **fields: Any) -> CacheConfig:
        """A config whose num_pages is the most that fits `budget_bytes`.

        Like vLLM's gpu_memory_utilization: the caller passes the bytes left for
        the cache; `fields` are every CacheConfig field except num_pages.
        """
        if "num_pages" in fields:
            raise ValueError(f"num_pages = {fields['num_pages']!r} given, from_budget chooses it")
        probe = cls(num_pages=2, **fields)
        return dataclasses.replace(probe, num_pages=probe.num_pages_for_budget(budget_bytes))
