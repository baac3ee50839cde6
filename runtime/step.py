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

from glint.export.checkpoint import flatten, unflatten
from glint.kvcache import CacheConfig, KVState, apply_copies
from glint.model import dflash, tp, transformer
from glint.model.attention import LayerAttention
from glint.model.config import ModelConfig
from glint.model.dflash import DraftConfig
from glint.pallas_kernels import (qkv_write, ring_write, ring_write_reference, varlen_attention,
                                  varlen_attention_reference)
from glint.runtime.params import MAX_LOGPROBS
from glint.runtime.programs import (COPY_DONATE_ARGNUMS, DRAFT_DONATE_ARGNUMS, FORWARD_DONATE_ARGNUMS,
                                    TABLES_DONATE_ARGNUMS, DeviceMeta, Program, ProgramSet, StepLayout, abstract_args,
                                    apply_table_changes, draft_name, forward_name, kv_sharding, penalize_names)
from glint.runtime.sampling import SamplerInputs, logprobs, penalize, sample, sample_argmax


@dataclass(frozen=True)
class PagedAttention:
    """The model's attention backend over the paged state: write this step's K/V, then attend.

    impl: "pallas" (GPU kernels), "interpret" (the same kernels in the Pallas interpreter) or
    "reference" (pure jnp). `causal=False`: every query sees its sequence's keys up to the step's end (a
    DFlash draft block).
    """

    cache: CacheConfig
    impl: str
    causal: bool = True

    def write(self, index: int, pages: tuple, k, v, meta: DeviceMeta) -> tuple:
        """Layer `index`'s pools (k, v), or (k, v, k_scale, v_scale) in a scaled cache (KVState.layers), with
        this step's rows written at their slots."""
        slots = meta.slots[self.cache.layer_group[index]]
        if self.impl == "reference":
            return ring_write_reference(*pages[:2], k, v, slots, *pages[2:])
        return ring_write(*pages[:2], k, v, slots, *pages[2:], interpret=self.impl == "interpret")

    def __call__(self, layer: LayerAttention, q, k, v, cache: tuple, meta: DeviceMeta):
        pages = self.write(layer.index, cache, k, v, meta)
        return self.attend(layer, q, pages, meta), pages

    def attend_qkv(self, layer: LayerAttention, qkv, prep, cache: tuple, meta: DeviceMeta):
        """The model's projection [T, Hq + 2 Hkv, D] whole (model.transformer.QKVPrep says how to norm and rotate
        it): with the kernels and pools in the activations' dtype one `qkv_write` kernel norms, rotates and
        writes; otherwise the model's own split, then the write and the attention."""
        if qkv.shape[1] != prep.num_heads + 2 * cache[0].shape[2]:
            raise ValueError(f"layer {layer.index}: a projection of {qkv.shape[1]} heads is not {prep.num_heads} q "
                             f"heads + 2 x the pools' {cache[0].shape[2]} kv heads")
        if self.impl == "reference" or len(cache) != 2 or cache[0].dtype != qkv.dtype:
            return self(layer, *prep.split(qkv), cache, meta)
        rope = None if prep.rope is None else tuple(x[:, 0, :] for x in prep.rope)
        q, *pages = qkv_write(*cache, qkv, meta.slots[self.cache.layer_group[layer.index]], rope, prep.q_norm,
                              prep.k_norm, qk_norm=prep.qk_norm, eps=prep.eps, interpret=self.impl == "interpret")
        return self.attend(layer, q, tuple(pages), meta), tuple(pages)

    def attend(self, layer: LayerAttention, q, pages: tuple, meta: DeviceMeta):
        """q [T, Hq, D] over layer `layer.index`'s pools (with this step's rows written) -> [T, Hq, D]."""
        group = self.cache.layer_group[layer.index]
        if self.impl == "reference":
            attend = varlen_attention_reference
        else:
            attend = functools.partial(varlen_attention, interpret=self.impl == "interpret")
        scales = dict(zip(("k_scale", "v_scale"), pages[2:]))
        return attend(q, *pages[:2], meta.page_tables[group], meta.seq_info, **scales,
                      ring_rows=self.cache.group_ring_rows(group), window=layer.window, causal=self.causal,
                      softcap=layer.softcap, scale=layer.scale)


def run_model(graphdef, backend, params, kv: KVState, tokens, meta: DeviceMeta, rows,
              draft: DraftConfig | None = None, flat: dict | None = None, axis: str | None = None):
    """Forward over the step's tokens; logits f32[R, V] only for the selected `rows` i32[R]. `axis`: the
    tensor-parallel mesh axis, when this runs one device's shard of the model (model/tp.py).

    With a DFlash `draft` (its weights in the `flat` dict) the step also writes every row's draft context (the
    tapped target layers through `fc` and `hidden_norm`, then each draft layer's K/V) into the draft's pools,
    the cache layers after the target's: a rejected row's context is overwritten when its position is fed
    again."""
    n = len(kv.k) - (draft.num_layers if draft is not None else 0)  # the target's layers come first
    taps = draft.target_layer_ids if draft is not None else ()
    pools = kv.layers()
    hidden, layers, *tapped = transformer.forward(graphdef, params, tokens, meta.positions, backend, pools[:n], meta,
                                                  taps=taps, axis=axis)
    if draft is not None:
        dp = dflash.unflatten_params(flat, draft)
        features = dflash.context_features(dp, draft, tapped[0])
        for i in range(draft.num_layers):
            layers.append(backend.write(n + i, pools[n + i],
                                        *dflash.context_kv(dp, draft, i, features, meta.positions), meta))
    kv = KVState.from_layers(layers)
    return transformer.compute_logits(graphdef, params, hidden[rows], axis), kv


@functools.lru_cache(maxsize=64)
def make_draft_fn(model: ModelConfig, cache: CacheConfig, impl: str, draft: DraftConfig, layout: StepLayout):
    """The DFlash drafting program (one per width), run before a step that verifies blocks: (flat params,
    KVState.parts(), page tables, host i32[N] packed by `layout`) -> (draft tokens i32[R], KVState.parts()); it
    reads the tables with the step's changes applied and leaves keeping them to the step.

    Over the very step the target then runs: rows with token_src >= 0 (draft positions) become mask tokens,
    every row goes through the draft layers, whose block K/V are written at the step's slots (the target's
    step overwrites them with context) and attended without a causal mask; row r of the output is the
    draft's argmax at step row draft_rows[r].
    """
    backend = PagedAttention(cache, impl, causal=False)
    graphdef, like = transformer.split(transformer.abstract_model(model))
    n = model.num_layers

    def run(params, kv, tables, host):
        parts = layout.unpack(host)
        meta = layout.meta(parts, apply_table_changes(tables, layout.table_changes(parts)))
        tokens, token_src, rows = parts["tokens"], parts["token_src"], parts["draft_rows"]
        target = transformer.merge(graphdef, unflatten(params, like))
        pools = KVState(*kv).layers()

        def attend(i, q, k_block, v_block):
            spec = LayerAttention(n + i, 0, 0.0, draft.scale)
            out, pools[n + i] = backend(spec, q, k_block, v_block, pools[n + i], meta)
            return out

        block = target.embed_tokens(jnp.where(token_src >= 0, draft.mask_token_id, tokens))
        hidden = dflash.draft_block(dflash.unflatten_params(params, draft), draft, block, meta.positions, attend)
        return sample_argmax(target.logits(hidden[rows])), KVState.from_layers(pools).parts()

    return jax.jit(run, donate_argnums=DRAFT_DONATE_ARGNUMS)


@functools.lru_cache(maxsize=64)
def make_step_fn(model: ModelConfig, cache: CacheConfig, impl: str, layout: StepLayout,
                 draft: DraftConfig | None = None, tensor_parallel: int = 1):
    """The engine's step (one program per width): (flat params, KVState.parts(), page tables, host i32[N],
    prev_tokens i32[R]) -> (tokens i32[R], logits f32[R, V], KVState.parts(), page tables), where `host` holds the
    step's tokens, token_src, metadata (with the page-table entries set since the last step, applied to the
    tables first), rows and sampler packed by `layout` (one upload per step; programs.StepLayout). With a DFlash
    `draft`, the step also writes the draft's context (`run_model`). With `tensor_parallel` N > 1 it runs under
    shard_map over N devices, each on its shard of the model (model/tp.py) and of the KV pools; what it
    returns besides the pools is the same on every device.

    Token t is `prev_tokens[token_src[t]]` where token_src[t] >= 0 (a token sampled by the previous
    step, still on the device), else `tokens[t]`. The returned tokens are drawn with min-p but without
    top-k/top-p (greedy rows: argmax); rows that rank (top-k/top-p) are redrawn from the logits by the
    `sample` program, so no sampler variant needs a program of its own. Cached, so engines of one model and
    cache geometry share their programs.
    """
    backend = PagedAttention(cache, impl)
    n = tensor_parallel
    graphdef, like = transformer.split(transformer.abstract_model(tp.local_config(model, n)))
    axis = tp.AXIS if n > 1 else None

    def step(params, kv, tables, host, prev_tokens):
        parts = layout.unpack(host)
        tables = apply_table_changes(tables, layout.table_changes(parts))
        token_src = parts["token_src"]
        tokens = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], parts["tokens"])
        logits, kv = run_model(graphdef, backend, unflatten(params, like), KVState(*kv), tokens,
                               layout.meta(parts, tables), parts["rows"], draft, params, axis)
        logits = logits[:, :model.vocab_size]  # under tensor parallelism, the vocabulary's padding cut off
        tokens = sample(logits, SamplerInputs.from_columns(layout.sampler(parts)), is_filtered=False)
        return tokens, logits, kv.parts(), tables

    if n > 1:
        from jax.sharding import PartitionSpec as P

        pools = tuple(tuple(s.spec for _ in range(cache.num_layers)) for s in kv_sharding(cache, tp.mesh(n)))
        tables = (P(),) * cache.num_groups
        # check_vma off: the Pallas calls declare no varying axes; the replicated outputs are replicated by
        # construction (everything after the logits' all-gather is the same computation on every device).
        step = jax.shard_map(step, mesh=tp.mesh(n),
                             in_specs=(tp.param_specs(model, flatten(like)), pools, tables, P(), P()),
                             out_specs=(P(), P(), pools, tables), check_vma=False)
    return jax.jit(step, donate_argnums=FORWARD_DONATE_ARGNUMS)


@jax.jit
def _sample_filtered(logits, sampler):
    return sample(logits, SamplerInputs.from_columns(sampler), is_filtered=True)


@jax.jit
def _penalize(logits, penalties, prev_tokens, sampler):
    logits = penalize(logits, *penalties, prev_tokens)
    return logits, sample(logits, SamplerInputs.from_columns(sampler), is_filtered=False)


@jax.jit
def _sample_argmax(logits):
    return sample_argmax(logits)


@jax.jit
def _logprobs(logits, tokens):
    return tuple(logprobs(logits, tokens, MAX_LOGPROBS))


def _pools_placed(cache: CacheConfig, tensor_parallel: int) -> tuple | None:
    """The KV pools' shardings (KVState.parts()) over a tensor-parallel mesh: split by KV head (one device: none)."""
    if tensor_parallel == 1:
        return None
    return tuple((s,) * cache.num_layers for s in kv_sharding(cache, tp.mesh(tensor_parallel)))


def _tables_placed(cache: CacheConfig, tensor_parallel: int) -> tuple | None:
    """The page tables' shardings over a tensor-parallel mesh: replicated (one device: none)."""
    if tensor_parallel == 1:
        return None
    return (jax.sharding.NamedSharding(tp.mesh(tensor_parallel), jax.sharding.PartitionSpec()),) * cache.num_groups


def _placed(out_shardings) -> dict:
    """jit's keyword arguments for a program's output shardings (None: jit's own placement)."""
    return {} if out_shardings is None else {"out_shardings": out_shardings}


def zero_tables(cache: CacheConfig, max_seqs: int) -> tuple:
    """Per layer group an empty page table i32[max_seqs, P_g] (every entry the scratch page)."""
    return tuple(jnp.zeros((max_seqs, cache.group_pages_per_seq(g)), jnp.int32) for g in range(cache.num_groups))


@functools.lru_cache(maxsize=16)
def make_kv_init_fn(cache: CacheConfig, max_seqs: int, tensor_parallel: int = 1):
    """(the zeroed KV pools, KVState.parts(); the zeroed page tables): a program, so an engine (an artifact too)
    creates them without compiling."""

    def kv_init():
        return KVState.create(cache).parts(), zero_tables(cache, max_seqs)

    pools = _pools_placed(cache, tensor_parallel)
    return jax.jit(kv_init, **_placed(None if pools is None else (pools, _tables_placed(cache, tensor_parallel))))


@functools.lru_cache(maxsize=16)
def make_tables_fn(cache: CacheConfig, tensor_parallel: int = 1):
    """Page-table entries beyond a step's upload (programs.Runner.update_tables)."""
    return jax.jit(apply_table_changes, donate_argnums=TABLES_DONATE_ARGNUMS,
                   **_placed(_tables_placed(cache, tensor_parallel)))


@functools.lru_cache(maxsize=16)
def make_copy_fn(cache: CacheConfig, tensor_parallel: int = 1):
    """Copy-on-write page copies, run before a step that writes into shared pages (each device its heads')."""

    def copy(kv, copies):
        return apply_copies(KVState(*kv), cache, copies).parts()

    return jax.jit(copy, donate_argnums=COPY_DONATE_ARGNUMS, **_placed(_pools_placed(cache, tensor_parallel)))


def live_programs(model: ModelConfig, params: dict, cache: CacheConfig, impl: str, widths, max_seqs: int,
                  rows: int, draft: DraftConfig | None = None, tensor_parallel: int = 1) -> ProgramSet:
    """Every program an engine runs, for the live model (params: the flat parameter dict, with the draft's
    under "draft."; with `tensor_parallel` N > 1, global arrays on the N-device mesh, `tp.shard_params`); a
    DFlash `draft` adds its drafting programs."""
    n = tensor_parallel
    if n > 1 and draft is not None:
        raise ValueError(f"tensor_parallel {n} with a DFlash draft is not supported (the draft runs on one device): "
                         "use tensor_parallel=1, or an n-gram drafter")
    layouts = {w: StepLayout.of(w, cache, max_seqs, rows) for w in widths}
    fns = {forward_name(w): make_step_fn(model, cache, impl, layouts[w], draft, n) for w in widths}
    fns.update({name: _penalize for name in penalize_names(cache.capacity)})
    fns.update(sample=_sample_filtered, sample_argmax=_sample_argmax, logprobs=_logprobs,
               copy=make_copy_fn(cache, n), tables=make_tables_fn(cache, n),
               kv_init=make_kv_init_fn(cache, max_seqs, n))
    if draft is not None:
        fns.update({draft_name(w): make_draft_fn(model, cache, impl, draft, layouts[w]) for w in widths})
    mesh = tp.mesh(n) if n > 1 else None
    programs = {name: Program(fn, abstract_args(name, params, cache, max_seqs, rows, model.vocab_size, mesh))
                for name, fn in fns.items()}
    identity = repr((model, cache, impl, max_seqs, rows, draft, n,
                     sorted((k, v.shape, str(v.dtype)) for k, v in params.items())))
    return ProgramSet(programs, identity=identity)
