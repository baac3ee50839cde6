"""Jitted step functions over the paged KV state: forward, selected-row logits, on-device sampling."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from glint.kvcache import CacheConfig, KVState, StepMetadata, apply_copies
from glint.model import transformer
from glint.model.attention import LayerAttention
from glint.pallas_kernels import (ring_write, ring_write_reference, varlen_attention,
                                  varlen_attention_reference)
from glint.runtime.params import MAX_LOGPROBS
from glint.runtime.sampling import SamplerInputs, logprobs, sample


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DeviceMeta:
    """The int32 metadata of one step, as the jitted function sees it."""

    positions: jax.Array  # i32[W]
    slots: tuple[jax.Array, ...]  # per layer group, i32[W]
    seq_info: jax.Array  # i32[S, 4]
    page_tables: tuple[jax.Array, ...]  # per layer group, i32[S, P_g]

    @classmethod
    def from_host(cls, meta: StepMetadata) -> DeviceMeta:
        return cls(meta.positions, tuple(meta.slots), meta.seq_info, tuple(meta.page_tables))


@dataclass(frozen=True)
class PagedAttention:
    """The model's attention backend over the paged state: write this step's K/V, then attend.

    impl: "pallas" (GPU kernels), "interpret" (the same kernels in the Pallas interpreter) or
    "reference" (pure jnp).
    """

    cache: CacheConfig
    impl: str

    def __call__(self, layer: LayerAttention, q, k, v, cache, meta: DeviceMeta):
        k_pages, v_pages = cache
        group = self.cache.layer_group[layer.index]
        if self.impl == "reference":
            k_pages, v_pages = ring_write_reference(k_pages, v_pages, k, v, meta.slots[group])
            attend = varlen_attention_reference
        else:
            interpret = self.impl == "interpret"
            k_pages, v_pages = ring_write(k_pages, v_pages, k, v, meta.slots[group], interpret=interpret)
            attend = functools.partial(varlen_attention, interpret=interpret)
        out = attend(q, k_pages, v_pages, meta.page_tables[group], meta.seq_info,
                     ring_rows=self.cache.group_ring_rows(group), window=layer.window, causal=True,
                     softcap=layer.softcap, scale=layer.scale)
        return out, (k_pages, v_pages)


def run_model(graphdef, backend, params, kv: KVState, tokens, meta: DeviceMeta, rows):
    """Forward over the step's tokens; logits f32[R, V] only for the selected `rows` i32[R]."""
    hidden, layers = transformer.forward(graphdef, params, tokens, meta.positions, backend,
                                         list(zip(kv.k, kv.v)), meta)
    kv = KVState(k=tuple(k for k, _ in layers), v=tuple(v for _, v in layers))
    return transformer.compute_logits(graphdef, params, hidden[rows]), kv


@functools.lru_cache(maxsize=16)
def make_step_fn(graphdef, cache: CacheConfig, impl: str):
    """The engine's step: (params, kv, tokens, token_src, prev_tokens, meta, rows, sampler)
    -> (next tokens i32[R], logprobs, kv).

    Token t is `prev_tokens[token_src[t]]` where token_src[t] >= 0 (a token sampled by the previous
    step, still on the device), else `tokens[t]`.

    Static flags: `is_filtered` (some row uses top-k/top-p) and `num_logprobs` (0: none returned).
    Cached, so engines of one model and cache geometry share their compiled executables.
    """
    backend = PagedAttention(cache, impl)

    def step(params, kv, tokens, token_src, prev_tokens, meta, rows, sampler: SamplerInputs, *, is_filtered: bool,
             num_logprobs: int):
        tokens = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], tokens)
        logits, kv = run_model(graphdef, backend, params, kv, tokens, meta, rows)
        next_tokens = sample(logits, sampler, is_filtered=is_filtered)
        lp = logprobs(logits, next_tokens, num_logprobs) if num_logprobs else None
        return next_tokens, lp, kv

    return jax.jit(step, donate_argnums=(1,), static_argnames=("is_filtered", "num_logprobs"))


@functools.lru_cache(maxsize=16)
def make_copy_fn(cache: CacheConfig):
    """Copy-on-write page copies, run before a step that writes into shared pages."""
    return jax.jit(lambda kv, copies: apply_copies(kv, cache, copies), donate_argnums=(0,))


def num_logprobs_bucket(k: int) -> int:
    """Logprobs requests share a few compiled variants: 0, or MAX_LOGPROBS alternatives."""
    return 0 if k == 0 else MAX_LOGPROBS


def pad_rows(rows: list[int], num_rows: int) -> np.ndarray:
    out = np.zeros(num_rows, np.int32)
    out[: len(rows)] = rows
    return out
