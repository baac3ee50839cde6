"""The model's one narrow attention interface, and the dense full-sequence backend.

The model computes q, k, v (after norms and RoPE) and hands them to a backend together with an
opaque cache state and step metadata; the backend returns the attention output and the new cache.
The dense backend below attends over the step's own tokens (no cache); the paged backend in
`glint.runtime` writes K/V into the paged state and runs the varlen kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class LayerAttention:
    """Static facts of one attention layer that a backend needs."""

    index: int
    window: int  # 0: global attention
    softcap: float  # 0: off
    scale: float


class AttentionBackend(Protocol):
    def __call__(self, layer: LayerAttention, q: jax.Array, k: jax.Array, v: jax.Array,
                 cache: Any, meta: Any) -> tuple[jax.Array, Any]:
        """q [T, Hq, D], k/v [T, Hkv, D] -> ([T, Hq, D], new cache)."""
        ...


@runtime_checkable
class FusedQKVBackend(Protocol):
    """A backend that also takes a layer's fused projection before its q/k norms and RoPE, to fuse them with its
    cache write; the model calls `attend_qkv` instead of `__call__` when the backend has it."""

    def attend_qkv(self, layer: LayerAttention, qkv: jax.Array, prep: Any, cache: Any,
                   meta: Any) -> tuple[jax.Array, Any]:
        """qkv [T, Hq + 2 Hkv, D]; prep: model.transformer.QKVPrep (its `split` is the reference) ->
        ([T, Hq, D], new cache)."""
        ...


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DenseMeta:
    """Metadata of the dense path: token t belongs to sequence segment_ids[t] (-1: padding)."""

    positions: jax.Array  # i32[T]
    segment_ids: jax.Array  # i32[T]

    @classmethod
    def single(cls, num_tokens: int) -> DenseMeta:
        return cls(jnp.arange(num_tokens, dtype=jnp.int32), jnp.zeros(num_tokens, jnp.int32))


def softmax_attention(q, k, v, mask, *, scale: float, softcap: float):
    """q [T, Hq, D], k/v [S, Hkv, D], mask bool[T, S] -> [T, Hq, D]; fully masked rows give zeros."""
    num_q, num_kv = q.shape[1], k.shape[1]
    qg = q.reshape(q.shape[0], num_kv, num_q // num_kv, q.shape[2]).astype(jnp.float32)
    highest = jax.lax.Precision.HIGHEST  # float32 math at full precision (no TF32 on GPU), as the model's matmuls
    s = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32), precision=highest) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("kgts,skd->tkgd", p / jnp.where(denom > 0, denom, 1.0), v.astype(jnp.float32), precision=highest)
    return out.reshape(q.shape).astype(q.dtype)


def dense_attention(layer: LayerAttention, q, k, v, cache, meta: DenseMeta):
    """Full-sequence causal attention among the step's tokens, with sliding window and soft-cap."""
    pos, seg = meta.positions, meta.segment_ids
    mask = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0) & (pos[None, :] <= pos[:, None])
    if layer.window:
        mask &= pos[None, :] > pos[:, None] - layer.window
    return softmax_attention(q, k, v, mask, scale=layer.scale, softcap=layer.softcap), cache
