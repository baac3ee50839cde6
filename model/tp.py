"""Tensor parallelism: the model split over a 1-D mesh of N devices (Megatron's layout, JAX's own sharding).

Each device holds 1/N of the attention heads and of the MLP's intermediate columns, and 1/N of the vocabulary
(embedding rows, head columns). The step runs under `jax.shard_map`: every device runs the model on its shard
(the Pallas kernels on its local heads and its local KV pools), with one all-reduce after the attention output
projection and one after the MLP down projection (`transformer.Block`); the token embedding is a masked lookup
plus an all-reduce, and the logits are all-gathered so the sampler sees the whole distribution, the same on
every device.

KV heads split across devices when N divides them; when N exceeds them (N a multiple of the KV heads), each KV
head is replicated on N / num_kv_heads devices (as vLLM does): each device still holds exactly the one KV head
its query heads read, and the KV pools hold N heads. The vocabulary is padded to a multiple of N (zero rows;
the padded logits are cut off after the gather).

The parameters are global arrays whose shard on device d is d's local block, in the local model's own layout:
the fused q/k/v kernel's shard is [d's q heads, its k heads, its v heads], gate_up's is [d's gate, d's up].
`shard_params` builds them from full-layout host arrays, each device's block cut and copied straight to it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from glint.model.config import ModelConfig

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one parameter splits: along its logical `dim` ("col": output features, "row": input features,
    "vocab": the vocabulary), in `segments` of the logical axis (each split 1/N per device, or "kv": KV heads,
    replicated when N exceeds them)."""

    dim: str
    segments: tuple[tuple[int, str], ...]  # (logical length, "split" | "kv")


def check(cfg: ModelConfig, n: int) -> None:
    """ValueError naming the value and the limit when `cfg` cannot be split over `n` devices."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel must be a positive int, got {n!r}")
    if n == 1:
        return
    available = len(jax.devices())
    if n > available:
        raise ValueError(f"tensor_parallel {n} exceeds the {available} {jax.default_backend()} device(s) here")
    if cfg.num_heads % n:
        raise ValueError(f"tensor_parallel {n} must divide num_heads {cfg.num_heads}")
    k = cfg.num_kv_heads
    if k % n and n % k:
        raise ValueError(f"tensor_parallel {n} must divide num_kv_heads {k} or be a multiple of it (then each KV "
                         "head is replicated)")
    if cfg.intermediate_size % n:
        raise ValueError(f"tensor_parallel {n} must divide intermediate_size {cfg.intermediate_size}")
    if cfg.quantize == "int4":
        for name, rows in (("num_heads * head_dim", cfg.num_heads * cfg.head_dim),
                           ("intermediate_size", cfg.intermediate_size)):
            if rows // n % cfg.quant_group:
                raise ValueError(f"tensor_parallel {n}: each device's {rows // n} input rows of the row-split "
                                 f"linears ({name} / {n}) must be whole int4 groups of {cfg.quant_group}")


def kv_heads(cfg: ModelConfig, n: int) -> int:
    """KV heads the model holds over `n` devices: its own, or `n` when they are replicated."""
    return max(cfg.num_kv_heads, n)


def padded_vocab(cfg: ModelConfig, n: int) -> int:
    return math.ceil(cfg.vocab_size / n) * n


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model one device runs: its heads, KV heads, intermediate columns and vocabulary rows."""
    if n == 1:
        return cfg
    return cfg.replace(num_heads=cfg.num_heads // n, num_kv_heads=kv_heads(cfg, n) // n,
                       intermediate_size=cfg.intermediate_size // n, vocab_size=padded_vocab(cfg, n) // n)


def layout(cfg: ModelConfig, name: str) -> Layout | None:
    """The split of flat parameter `name` ("layers.3.attn.wqkv.qweight"), None for a replicated one (norms)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear = name.rsplit(".", 1)[0]
    if name in ("embed", "embed_q", "embed_scale") or linear == "head":
        return Layout("vocab", ((cfg.vocab_size, "split"),))
    for pattern, lay in ((r"layers\.\d+\.attn\.wqkv", Layout("col", ((q, "split"), (kv, "kv"), (kv, "kv")))),
                         (r"layers\.\d+\.attn\.wg", Layout("col", ((q, "split"),))),
                         (r"layers\.\d+\.attn\.wo", Layout("row", ((q, "split"),))),
                         (r"layers\.\d+\.mlp\.gate_up", Layout("col", ((cfg.intermediate_size, "split"),) * 2)),
                         (r"layers\.\d+\.mlp\.down", Layout("row", ((cfg.intermediate_size, "split"),)))):
        if re.fullmatch(pattern, linear):
            return lay
    return None


def storage(cfg: ModelConfig, name: str, lay: Layout | None) -> tuple[int | None, int]:
    """(array axis the split runs along, logical entries per stored element) of parameter `name` in the weight
    format of `cfg` (model/quant.py): None for a replicated array (a row-split linear's per-column scale)."""
    if lay is None:
        return None, 1
    field = name.rsplit(".", 1)[-1]
    if lay.dim == "vocab":  # embed / embed_q [V, H], embed_scale [V], head kernel [H, V], head qweight [V, H]
        return (1 if name == "head.kernel" else 0), 1
    col = lay.dim == "col"
    if field == "kernel":  # [in, out]
        return (1 if col else 0), 1
    if field == "scale" and cfg.quantize != "int4":  # [out]
        return (0 if col else None), 1
    if field == "scale":  # int4 [in / group, out]
        return (1, 1) if col else (0, cfg.quant_group)
    if field != "qweight":
        raise ValueError(f"{name}: no tensor-parallel layout for a linear's {field!r} (kernel, qweight or scale)")
    # [out, in] (int4: u8[out, in / 2], two input rows per byte)
    return (0, 1) if col else (1, 2 if cfg.quantize == "int4" else 1)


def _ranges(cfg: ModelConfig, lay: Layout, d: int, n: int) -> list[tuple[int, int]]:
    """Device d's [start, stop) ranges of the logical axis of a parameter laid out as `lay`."""
    out, offset = [], 0
    for length, kind in lay.segments:
        if kind == "kv" and n > cfg.num_kv_heads:  # replicated: the KV head d's query heads read
            head = d // (n // cfg.num_kv_heads)
            out.append((offset + head * cfg.head_dim, offset + (head + 1) * cfg.head_dim))
        else:
            size = math.ceil(length / n) if lay.dim == "vocab" else length // n
            out.append((offset + d * size, offset + (d + 1) * size))
        offset += length
    return out


def local_block(cfg: ModelConfig, name: str, full, d: int, n: int):
    """Device d's shard of parameter `name`, cut from its full (unsplit) array: a host array, or a jax one
    (`relayout`)."""
    xp = jnp if isinstance(full, jax.Array) else np
    lay = layout(cfg, name)
    axis, unit = storage(cfg, name, lay)
    if axis is None:
        return full
    if lay.dim == "vocab" and full.shape[axis] < padded_vocab(cfg, n):  # zero rows up to a multiple of n
        pad = [(0, 0)] * full.ndim
        pad[axis] = (0, padded_vocab(cfg, n) - full.shape[axis])
        full = xp.pad(full, pad)
    parts = []
    for start, stop in _ranges(cfg, lay, d, n):
        if start % unit or stop % unit:
            raise ValueError(f"{name}: device {d}'s entries [{start}, {stop}) are not whole stored elements of "
                             f"{unit}")
        parts.append(xp.take(full, np.arange(start // unit, stop // unit), axis=axis))
    return xp.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]


@functools.lru_cache(maxsize=None)
def _relayout_fn(cfg: ModelConfig, n: int, kind: str, sharding: NamedSharding):
    """A jitted full array -> its split global array in `sharding` (one compile per kind of parameter and shape)."""
    axis = storage(cfg, kind, layout(cfg, kind))[0]

    def split(full):
        if axis is None:
            return full
        return jnp.concatenate([local_block(cfg, kind, full, d, n) for d in range(n)], axis=axis)

    return jax.jit(split, out_shardings=sharding)


def relayout(cfg: ModelConfig, n: int, name: str, full: jax.Array, sharding: NamedSharding) -> jax.Array:
    """A full-layout device array (replicated on the mesh: each device then cuts its block from its own copy, no
    communication) -> the split global array in `sharding`."""
    kind = re.sub(r"^layers\.\d+\.", "layers.0.", name)  # every layer's parameter of one kind splits alike
    return _relayout_fn(cfg, n, kind, sharding)(full)


@functools.lru_cache(maxsize=8)
def mesh(n: int) -> Mesh:
    """The 1-D mesh over the first `n` devices (of every process, under jax.distributed)."""
    return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def spec(cfg: ModelConfig, name: str) -> P:
    """The PartitionSpec of parameter `name` over the mesh."""
    axis = storage(cfg, name, layout(cfg, name))[0]
    return P() if axis is None else P(*([None] * axis + [AXIS]))


def param_specs(cfg: ModelConfig, like: dict) -> dict[str, P]:
    return {name: spec(cfg, name) for name in like}


def global_shapes(cfg: ModelConfig, n: int, local_like: dict) -> dict[str, jax.ShapeDtypeStruct]:
    """The global (mesh) shape of every parameter: its local shape, n times along its split axis, with the
    sharding it lives in."""
    out = {}
    for name, x in local_like.items():
        axis = storage(cfg, name, layout(cfg, name))[0]
        shape = list(x.shape)
        if axis is not None:
            shape[axis] *= n
        out[name] = jax.ShapeDtypeStruct(tuple(shape), x.dtype,
                                         sharding=NamedSharding(mesh(n), spec(cfg, name)))
    return out




def placer(cfg: ModelConfig, n: int, local_like: dict) -> Callable[[str, np.ndarray], jax.Array]:
    """place(name, full host array) -> the global array whose shard on each device is its block, copied there
    from the host alone (the full array never goes to a device)."""
    shapes = global_shapes(cfg, n, local_like)

    def place(name: str, full) -> jax.Array:
        full = np.asarray(full)
        target = shapes[name]
        full = full.astype(target.dtype) if full.dtype != target.dtype else full
        axis = storage(cfg, name, layout(cfg, name))[0]
        blocks = {}

        def block(index: tuple[slice, ...]) -> np.ndarray:
            d = 0 if axis is None else (index[axis].start or 0) // local_like[name].shape[axis]
            if d not in blocks:
                blocks[d] = np.ascontiguousarray(local_block(cfg, name, full, d, n))
            return blocks[d]

        return jax.make_array_from_callback(target.shape, target.sharding, block)

    return place


def shard_params(cfg: ModelConfig, n: int, flat: dict, local_like: dict) -> dict[str, jax.Array]:
    """Full-layout parameters (host arrays, or device arrays on one device or replicated) -> global arrays on the
    mesh; arrays already laid out for it (loaded by `placer`) are kept. ValueError for an array split in another
    way (e.g. for another device count): its full layout cannot be read back from it."""
    place, shapes = placer(cfg, n, local_like), global_shapes(cfg, n, local_like)
    out = {}
    for name, x in flat.items():
        sharding, want = getattr(x, "sharding", None), shapes[name]
        if sharding is not None and tuple(x.shape) == want.shape and \
                sharding.is_equivalent_to(want.sharding, len(want.shape)):
            out[name] = x
        elif sharding is None or len(sharding.device_set) == 1 or sharding.is_fully_replicated:
            out[name] = place(name, jax.device_get(x))
        else:
            raise ValueError(f"parameter {name!r} is split over {len(sharding.device_set)} devices in another layout "
                             f"than tensor_parallel={n}'s ({sharding}); pass the full (unsplit) parameters")
    return out
