"""Device side of the KV cache: per-layer page pools as a donated pytree."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glint.kvcache.config import CacheConfig
from glint.pallas_kernels.reference import scale_pool_shape

log = logging.getLogger(__name__)

# Budget assumed where a device reports no memory stats (CPU).
CPU_FALLBACK_BYTES = 1 << 30
# The default pool is sized from free memory rounded down to this, so the same machine gets the same pool
# (and the same compiled programs, found again in the persistent compilation cache) run after run.
POOL_GRANULE_BYTES = 1 << 30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVState:
    """Per-layer page pools, k[l] and v[l]: [num_pages, page_size, kv_heads, head_dim]; in a scaled cache
    (`CacheConfig.scaled`: float8_e4m3fn pools) also k_scale[l], v_scale[l]: f32[num_pages, kv_heads,
    page_size], the scale of each row and head (pallas_kernels/reference.py, `quantize_rows`,
    `scale_pool_shape`); else empty.

    Passed into the jitted step and returned (donated), so XLA updates it in
    place. Page 0 is the scratch page that padding rows write to.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    k_scale: tuple[jax.Array, ...] = ()
    v_scale: tuple[jax.Array, ...] = ()

    @classmethod
    def create(cls, cfg: CacheConfig) -> KVState:
        """Zeroed pools for `cfg` (placed by the caller: under jit, its out_shardings)."""

        def pool(layer: int) -> jax.Array:
            return jnp.zeros((cfg.num_pages, cfg.page_size, cfg.kv_heads[layer], cfg.head_dim[layer]), cfg.dtype)

        def scales(layer: int) -> jax.Array:
            return jnp.zeros(scale_pool_shape(cfg.num_pages, cfg.page_size, cfg.kv_heads[layer]), jnp.float32)

        layers = range(cfg.num_layers)
        return cls.from_layers([(pool(l), pool(l), *((scales(l), scales(l)) if cfg.scaled else ())) for l in layers])

    @classmethod
    def from_layers(cls, layers: Sequence[tuple[jax.Array, ...]]) -> KVState:
        """From per-layer tuples (k, v) or (k, v, k_scale, v_scale), what `layers` gives."""
        return cls(*(tuple(part) for part in zip(*layers)))

    def layers(self) -> list[tuple[jax.Array, ...]]:
        """Per layer (k, v), or (k, v, k_scale, v_scale) in a scaled cache: the attention backend's cache."""
        return list(zip(*self.parts()))

    def parts(self) -> tuple[tuple[jax.Array, ...], ...]:
        """(k, v) or (k, v, k_scale, v_scale): the programs' argument; `KVState(*parts)` inverts it."""
        return (self.k, self.v, self.k_scale, self.v_scale) if self.k_scale else (self.k, self.v)

    @property
    def num_layers(self) -> int:
        return len(self.k)


def pad_copies(copies: Sequence[np.ndarray], min_len: int = 1) -> tuple[np.ndarray, ...]:
    """Pad every group's copy list i32[n, 2] to one power-of-two length.

    Pads are (0, 0): scratch page onto itself, a no-op. One length for all
    groups, so `apply_copies` compiles for few shapes.
    """
    longest = max([len(c) for c in copies] + [min_len, 1])
    length = 1 << (longest - 1).bit_length()
    padded = []
    for c in copies:
        c = np.asarray(c, np.int32).reshape(-1, 2)
        padded.append(np.concatenate([c, np.zeros((length - len(c), 2), np.int32)]))
    return tuple(padded)


def apply_copies(state: KVState, cfg: CacheConfig, copies: Sequence[jax.Array | np.ndarray]) -> KVState:
    """Copy whole pages `src -> dst` in every layer of each group.

    Args:
      state: the pools.
      cfg: their geometry (static).
      copies: per group, i32[n, 2] rows (src_page, dst_page), e.g.
        `StepMetadata.copies` padded with `pad_copies`. All sources are read
        before any destination is written.
    Jit-friendly: shapes depend only on n; use inside the step or jit it alone.
    """
    if len(copies) != cfg.num_groups:
        raise ValueError(f"copies has {len(copies)} groups, cfg has {cfg.num_groups}")
    if len(state.k) != cfg.num_layers:
        raise ValueError(f"state has {len(state.k)} layers, cfg has {cfg.num_layers}")
    copies = [jnp.asarray(c, jnp.int32).reshape(-1, 2) for c in copies]

    def copy(pool: jax.Array, layer: int) -> jax.Array:
        pairs = copies[cfg.layer_group[layer]]
        if pairs.shape[0] == 0:
            return pool
        # (0, 0) pads scatter page 0 onto itself; duplicates all carry the same value.
        return pool.at[pairs[:, 1]].set(pool[pairs[:, 0]])

    return KVState(*(tuple(copy(pool, layer) for layer, pool in enumerate(part)) for part in state.parts()))


def free_device_bytes(fraction: float = 0.9, device: jax.Device | None = None) -> int:
    """Bytes the cache may take: `fraction` of device memory minus what is in use.

    Like vLLM's gpu_memory_utilization. From XLA's allocator where it reports its pool (`memory_stats`); on a GPU
    whose allocator does not (XLA's VMM allocator, which --xla_gpu_command_buffer_update_mode=SKIP_TEMP
    selects), from the driver: `fraction` of XLA's budget (`client_memory_fraction()` of the total, which that
    allocator keeps to) less what is taken. Devices with neither (CPU) get `fraction * CPU_FALLBACK_BYTES`.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction = {fraction!r}, must be in (0, 1]")
    device = jax.devices()[0] if device is None else device
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and "bytes_limit" in stats:
        return max(0, int(fraction * stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    if device.platform == "gpu":
        try:
            free, total = cuda_memory_info(device.local_hardware_id)
        except (OSError, AttributeError, RuntimeError) as e:  # no CUDA driver (ROCm is "gpu" too), or it failed
            log.warning("device memory unknown (%s): the KV pool gets the %d-byte fallback; set num_pages "
                        "(--num-pages) to size it", e, CPU_FALLBACK_BYTES)
        else:
            return max(0, int(fraction * client_memory_fraction() * total) - (total - free))
    return int(fraction * CPU_FALLBACK_BYTES)


def client_memory_fraction() -> float:
    """The share of a GPU's memory XLA's allocator may take: XLA_CLIENT_MEM_FRACTION (or the older
    XLA_PYTHON_CLIENT_MEM_FRACTION; jaxlib refuses both at once), else XLA's default, 0.75."""
    value = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    return float(value) if value else 0.75


def cuda_memory_info(ordinal: int) -> tuple[int, int]:
    """(free, total) bytes of CUDA device `ordinal` (as CUDA_VISIBLE_DEVICES numbers it), from the driver's
    cuMemGetInfo in the device's primary context (the one XLA runs in)."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(name: str, *args) -> None:
        if (err := getattr(cuda, name)(*args)) != 0:
            raise RuntimeError(f"{name} failed with CUDA error {err} (device {ordinal})")

    dev, ctx, free, total = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    check("cuInit", 0)
    check("cuDeviceGet", ctypes.byref(dev), ordinal)
    check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    try:
        check("cuCtxPushCurrent_v2", ctx)
        try:
            check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        finally:
            check("cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))
    finally:
        check("cuDevicePrimaryCtxRelease_v2", dev)
    return free.value, total.value


def default_num_pages(cfg: CacheConfig, fraction: float = 0.9, device: jax.Device | None = None) -> int:
    """num_pages that fits the free device memory, for `cfg`'s geometry.

    `cfg.num_pages` is ignored; build the final config with
    `dataclasses.replace(cfg, num_pages=default_num_pages(cfg))`. Budgets of two granules or more are
    rounded down to a whole number of POOL_GRANULE_BYTES.
    """
    return cfg.num_pages_for_budget(stable_budget(free_device_bytes(fraction, device)))


def stable_budget(num_bytes: int) -> int:
    """`num_bytes` rounded down to whole POOL_GRANULE_BYTES when it holds two or more of them."""
    return num_bytes // POOL_GRANULE_BYTES * POOL_GRANULE_BYTES if num_bytes >= 2 * POOL_GRANULE_BYTES else num_bytes
