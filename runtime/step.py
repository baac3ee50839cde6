"""The live model's programs: jitted step functions over the paged KV state, sampling, logprobs, page copies.

`live_programs` binds the model (graph definition + parameter layout) and the Pallas kernels into a
`ProgramSet` with the signatures `glint.runtime.programs` documents; `glint export` serializes the same
programs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from glint.export.checkpoint import unflatten
from glint.kvcache import CacheConfig, KVState, apply_copies
from glint.model import transformer
from glint.model.attention import LayerAttention
from glint.model.config import ModelConfig
from glint.pallas_kernels import (ring_write, ring_write_reference, varlen_attention,
                                  varlen_attention_reference)
from glint.runtime.params import MAX_LOGPROBS
from glint.runtime.programs import (COPY_DONATE_ARGNUMS, FORWARD_DONATE_ARGNUMS, SPEC_PROGRAMS, DeviceMeta, Program,
                                    ProgramSet, abstract_args, forward_name)
from glint.runtime.sampling import SamplerInputs, logprobs, sample, sample_argmax
from glint.runtime.spec import accept


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
def make_step_fn(model: ModelConfig, cache: CacheConfig, impl: str):
    """The engine's step (one program per width): (flat params, (k, v), tokens, token_src, prev_tokens,
    meta tuple, rows, sampler tuple) -> (tokens i32[R], logits f32[R, V], (k, v)).

    Token t is `prev_tokens[token_src[t]]` where token_src[t] >= 0 (a token sampled by the previous
    step, still on the device), else `tokens[t]`. The returned tokens are drawn without top-k/top-p
    (greedy rows: argmax); rows that filter are redrawn from the logits by the `sample` program, so no
    sampler variant needs a program of its own. Cached, so engines of one model and cache geometry
    share their programs.
    """
    backend = PagedAttention(cache, impl)
    graphdef, like = transformer.split(transformer.abstract_model(model))

    def step(params, kv, tokens, token_src, prev_tokens, meta, rows, sampler):
        tokens = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], tokens)
        meta = DeviceMeta(meta[0], tuple(meta[1]), meta[2], tuple(meta[3]))
        logits, kv = run_model(graphdef, backend, unflatten(params, like), KVState(*kv), tokens, meta, rows)
        return sample(logits, SamplerInputs(*sampler), is_filtered=False), logits, (kv.k, kv.v)

    return jax.jit(step, donate_argnums=FORWARD_DONATE_ARGNUMS)


@jax.jit
def _sample_filtered(logits, sampler):
    return sample(logits, SamplerInputs(*sampler), is_filtered=True)


@jax.jit
def _sample_argmax(logits):
    return sample_argmax(logits)


@jax.jit
def _logprobs(logits, tokens):
    return tuple(logprobs(logits, tokens, MAX_LOGPROBS))


def _accept_fn(is_filtered: bool):
    return jax.jit(lambda logits, sampler, proposed: accept(logits, SamplerInputs(*sampler), proposed,
                                                             is_filtered=is_filtered))


_ACCEPT = {name: _accept_fn(f) for name, f in zip(SPEC_PROGRAMS, (False, True))}


@functools.lru_cache(maxsize=16)
def make_kv_init_fn(cache: CacheConfig):
    """The zeroed KV pools, (k, v): a program, so an engine (an artifact too) creates them without compiling."""

    def kv_init():
        state = KVState.create(cache)
        return state.k, state.v

    return jax.jit(kv_init)


@functools.lru_cache(maxsize=16)
def make_copy_fn(cache: CacheConfig):
    """Copy-on-write page copies, run before a step that writes into shared pages."""

    def copy(kv, copies):
        out = apply_copies(KVState(*kv), cache, copies)
        return out.k, out.v

    return jax.jit(copy, donate_argnums=COPY_DONATE_ARGNUMS)


def live_programs(model: ModelConfig, params: dict, cache: CacheConfig, impl: str, widths, max_seqs: int,
                  rows: int, speculative: bool = False) -> ProgramSet:
    """Every program an engine runs, for the live model (params: the flat parameter dict); `speculative` adds
    the verification programs."""
    fns = {forward_name(w): make_step_fn(model, cache, impl) for w in widths}
    fns.update(sample=_sample_filtered, sample_argmax=_sample_argmax, logprobs=_logprobs, copy=make_copy_fn(cache),
               kv_init=make_kv_init_fn(cache))
    if speculative:
        fns.update(_ACCEPT)
    programs = {name: Program(fn, abstract_args(name, params, cache, max_seqs, rows, model.vocab_size))
                for name, fn in fns.items()}
    identity = repr((model, cache, impl, max_seqs, rows, sorted((k, v.shape, str(v.dtype)) for k, v in params.items())))
    return ProgramSet(programs, identity=identity)
