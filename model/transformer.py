"""Decoder-only transformer (Llama, Qwen3, Mistral, Gemma 2/3, Glimmer) as a Flax NNX module.

The forward is a pure function of (params, token ids, positions, attention backend, cache, metadata):
`forward` merges the module from its graph definition and parameters, so jitted step functions take
the parameters as an ordinary pytree. Norms, RoPE and softmax run in float32.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glint.model.attention import AttentionBackend, DenseMeta, FusedQKVBackend, LayerAttention, dense_attention
from glint.model.config import ModelConfig, RopeConfig
from glint.model import quant
from glint.model.quant import LINEARS


def _precision(dtype):
    """float32 models run at full float32 precision (no TF32 on GPU); low precision uses the default."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _init(rngs: nnx.Rngs, shape, dtype, scale: float):
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype))


def matmul(x, w):
    """x @ w [in, out] in x's dtype (float32 at full precision)."""
    return jnp.dot(x, w.astype(x.dtype), precision=_precision(x.dtype))


def rms_norm(x, weight, eps: float):
    """RMSNorm in float32, back in x's dtype; `weight` None: no scale."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight
    return y.astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ kernel, kernel [in, out]."""

    def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs):
        self.kernel = _init(rngs, (d_in, d_out), dtype, d_in ** -0.5)

    def __call__(self, x, axis: str | None = None):
        """`axis` (a row-split linear's tensor-parallel axis) matters only to fp8's activation scales."""
        return matmul(x, self.kernel[...])


def linear(cfg: ModelConfig, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs):
    """A layer's linear in the weight format of `cfg.quantize`."""
    if cfg.quantize == "none":
        return Linear(d_in, d_out, dtype=dtype, rngs=rngs)
    return LINEARS[cfg.quantize](d_in, d_out, dtype=dtype, rngs=rngs, group=cfg.quant_group)


class RMSNorm(nnx.Module):
    """RMSNorm in float32; `scaled=False` has no weight (Glimmer's q/k norm)."""

    def __init__(self, dim: int, eps: float, *, scaled: bool = True):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32)) if scaled else None

    def __call__(self, x):
        return rms_norm(x, None if self.weight is None else self.weight[...], self.eps)


@functools.lru_cache(maxsize=64)
def rope_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies f64[head_dim // 2] after the rope_type's scaling (HF semantics)."""
    inv = 1.0 / rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv


def rope_table(rope: RopeConfig, head_dim: int, positions):
    """(cos, sin) f32[T, 1, head_dim // 2] of one RoPE at positions i32[T], for `apply_rope`."""
    inv_freq = jnp.asarray(rope_frequencies(rope, head_dim), jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def rope_tables(cfg: ModelConfig, positions) -> dict:
    """{RopeConfig: (cos, sin) f32[T, 1, head_dim // 2]} for each distinct RoPE of the model's layers: computed
    once per step from positions i32[T] and shared by every layer that uses it (not twice per layer)."""
    return {rope: rope_table(rope, cfg.head_dim, positions) for rope in dict.fromkeys(cfg.layer_rope)
            if rope is not None}


def apply_rope(x, table):
    """Rotate-half RoPE (HF layout). x [T, H, D]; table: (cos, sin) f32[T, 1, D // 2] from `rope_tables`."""
    cos, sin = table
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@dataclass(frozen=True)
class QKVPrep:
    """How a layer turns its fused q/k/v projection [T, Hq + 2 Hkv, D] into attention inputs: per-head RMSNorm of q
    and k (`qk_norm` as ModelConfig's, weights f32[D] when "rms"), then RoPE by `rope` ((cos, sin) f32[T, 1, D // 2]
    from `rope_tables`, or None). `split` is the reference; a backend may fuse it with its cache write."""

    num_heads: int
    rope: tuple | None
    qk_norm: str
    q_norm: jax.Array | None
    k_norm: jax.Array | None
    eps: float

    def split(self, qkv):
        """-> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]), normed and rotated."""
        num_kv = (qkv.shape[1] - self.num_heads) // 2
        q, k, v = jnp.split(qkv, [self.num_heads, self.num_heads + num_kv], axis=1)
        if self.qk_norm != "none":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        if self.rope is not None:
            q, k = apply_rope(q, self.rope), apply_rope(k, self.rope)
        return q, k, v


def _norm_weight(norm: RMSNorm | None):
    return None if norm is None or norm.weight is None else norm.weight[...]


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, *, dtype, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.spec = LayerAttention(index, cfg.layer_windows[index], cfg.attn_softcap, cfg.scale)
        self.rope = cfg.layer_rope[index]
        # q, k and v in one matmul: one wide weight read instead of three narrow ones (decode is bound by it)
        self.wqkv = linear(cfg, d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, dtype=dtype, rngs=rngs)
        self.wo = linear(cfg, cfg.num_heads * hd, d, dtype=dtype, rngs=rngs)
        self.wg = linear(cfg, d, cfg.num_heads * hd, dtype=dtype, rngs=rngs) if cfg.attn_output_gate else None
        has_qk_norm, scaled = cfg.qk_norm != "none", cfg.qk_norm == "rms"
        self.qk_norm, self.eps = cfg.qk_norm, cfg.norm_eps
        self.q_norm = RMSNorm(hd, cfg.norm_eps, scaled=scaled) if has_qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps, scaled=scaled) if has_qk_norm else None

    def __call__(self, x, rope: dict, attend: AttentionBackend, cache, meta, axis: str | None = None):
        t = x.shape[0]
        qkv = self.wqkv(x).reshape(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        prep = QKVPrep(self.num_heads, None if self.rope is None else rope[self.rope], self.qk_norm,
                       _norm_weight(self.q_norm), _norm_weight(self.k_norm), self.eps)
        if isinstance(attend, FusedQKVBackend):
            out, cache = attend.attend_qkv(self.spec, qkv, prep, cache, meta)
        else:
            out, cache = attend(self.spec, *prep.split(qkv), cache, meta)
        out = out.reshape(t, self.num_heads * self.head_dim)
        if self.wg is not None:
            out = out * jax.nn.sigmoid(self.wg(x).astype(jnp.float32)).astype(out.dtype)
        return self.wo(out, axis), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.activation = cfg.activation
        self.gate_up = linear(cfg, cfg.hidden_size, 2 * cfg.intermediate_size, dtype=dtype, rngs=rngs)
        self.down = linear(cfg, cfg.intermediate_size, cfg.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, axis: str | None = None):
        if quant.fuses_fp8_mlp(self.gate_up, self.down, self.activation, axis):
            return quant.fp8_gated_mlp(x, self.gate_up, self.down)
        g, u = jnp.split(self.gate_up(x), 2, axis=-1)
        g = jax.nn.silu(g) if self.activation == "silu" else jax.nn.gelu(g, approximate=True)
        return self.down(g * u, axis)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, *, dtype, rngs: nnx.Rngs):
        eps = cfg.norm_eps
        self.attn_norm = RMSNorm(cfg.hidden_size, eps)
        self.attn = Attention(cfg, index, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
        self.attn_post_norm = RMSNorm(cfg.hidden_size, eps) if cfg.sandwich_norm else None
        self.mlp_post_norm = RMSNorm(cfg.hidden_size, eps) if cfg.sandwich_norm else None

    def __call__(self, x, rope: dict, attend, cache, meta, axis: str | None = None):
        """`axis`: under tensor parallelism (model/tp.py), the mesh axis the attention and MLP outputs are summed
        over (each device computed its heads' and columns' share)."""
        h, cache = self.attn(self.attn_norm(x), rope, attend, cache, meta, axis)
        if axis is not None:
            h = jax.lax.psum(h, axis)
        if self.attn_post_norm is not None:
            h = self.attn_post_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x), axis)
        if axis is not None:
            h = jax.lax.psum(h, axis)
        if self.mlp_post_norm is not None:
            h = self.mlp_post_norm(h)
        return x + h, cache


class Transformer(nnx.Module):
    """Token ids -> final hidden states; `logits` applies the head to selected rows only."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        table = jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size)).astype(dtype)
        if cfg.quantize_head and cfg.tie_embeddings:  # the table is the head: int8 per vocab entry (row)
            q, scale = quant.quantize_int8_rows(table)
            self.embed, self.embed_q, self.embed_scale = None, nnx.Param(q), nnx.Param(scale)
        else:
            self.embed = nnx.Param(table)
        self.embed_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.embed_norm else None
        self.layers = nnx.List([Block(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        head = quant.Int8Linear if cfg.quantize_head else Linear
        self.head = None if cfg.tie_embeddings else head(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    def embed_tokens(self, tokens, axis: str | None = None):
        """Rows of the embedding table (dequantized from int8 with an int8 tied head). `axis`: the table is this
        device's slice of the vocabulary (model/tp.py); the others' rows come from the all-reduce."""
        if axis is not None:
            vocab = self.cfg.vocab_size  # this device's rows
            local = tokens - jax.lax.axis_index(axis) * vocab
            mine = (local >= 0) & (local < vocab)
            rows = self.embed_tokens(jnp.where(mine, local, 0))
            return jax.lax.psum(jnp.where(mine[:, None], rows, jnp.zeros_like(rows)), axis)
        if self.embed is not None:
            return self.embed[...][tokens]
        rows = self.embed_q[...][tokens].astype(jnp.float32) * self.embed_scale[...][tokens][:, None]
        return rows.astype(jnp.dtype(self.cfg.dtype))

    def __call__(self, tokens, positions, attend: AttentionBackend, cache, meta, taps: tuple[int, ...] = (),
                 axis: str | None = None):
        """tokens, positions i32[T]; cache: a per-layer sequence handed to the backend (or None); `axis`: the
        tensor-parallel mesh axis when this is one device's shard of the model (model/tp.py).

        With `taps` (layer ids) it also returns the residual stream after each tapped layer, concatenated
        in the order given: f[T, len(taps) * hidden_size], what a DFlash draft reads. As HF's
        hidden_states[-1], a tap on the last layer reads the final-normed output.
        """
        bad = [i for i in taps if not 0 <= i < self.cfg.num_layers]
        if bad:
            raise ValueError(f"taps {bad} are not layer ids of a {self.cfg.num_layers}-layer model")
        x = self.embed_tokens(tokens, axis)
        if self.cfg.embed_scale:  # Gemma rounds the normaliser to the activation dtype
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, x.dtype)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        rope, new_cache, outputs = rope_tables(self.cfg, positions), [], []
        for i, block in enumerate(self.layers):
            x, layer_cache = block(x, rope, attend, None if cache is None else cache[i], meta, axis)
            new_cache.append(layer_cache)
            outputs.append(x)
        x, new_cache = self.norm(x), (None if cache is None else type(cache)(new_cache))
        if not taps:
            return x, new_cache
        outputs[-1] = x
        return x, new_cache, jnp.concatenate([outputs[i] for i in taps], axis=-1)

    def logits(self, hidden, axis: str | None = None):
        """hidden [R, hidden_size] -> float32 logits [R, vocab]; `axis`: this device's slice of the vocabulary,
        all-gathered into the whole (padded) vocabulary on every device (model/tp.py)."""
        if self.cfg.quantize_head:  # int8 q [V, H], scale per vocab entry (tied: the table's)
            q, scale = (self.embed_q, self.embed_scale) if self.head is None else (self.head.qweight, self.head.scale)
            out = quant.int8_matmul(hidden, q[...], scale[...], jnp.float32)
        else:
            w = self.embed[...].T if self.head is None else self.head.kernel[...]
            out = jnp.dot(hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32,
                          precision=_precision(hidden.dtype))
        if self.cfg.final_softcap:
            out = self.cfg.final_softcap * jnp.tanh(out / self.cfg.final_softcap)
        return out if axis is None else jax.lax.all_gather(out, axis, axis=1, tiled=True)


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStruct leaves: costs no memory, for any size."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def split(model: Transformer):
    """(graphdef, params) where params is a plain nested dict of arrays."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def merge(graphdef, params) -> Transformer:
    return nnx.merge(graphdef, params)


def forward(graphdef, params, tokens, positions, attend: AttentionBackend, cache, meta,
            taps: tuple[int, ...] = (), axis: str | None = None):
    """Pure forward: -> (final hidden [T, hidden_size], new cache), and the tapped layers' features
    f[T, len(taps) * hidden_size] third when `taps` is given (see `Transformer.__call__`)."""
    return merge(graphdef, params)(tokens, positions, attend, cache, meta, taps, axis)


def compute_logits(graphdef, params, hidden, axis: str | None = None):
    return merge(graphdef, params).logits(hidden, axis)


def full_sequence_logits(graphdef, params, tokens):
    """float32 logits [T, vocab] of one sequence by the full-sequence causal path (no cache): the oracle
    the cached paths are tested against."""
    n = len(tokens)
    positions = jnp.arange(n, dtype=jnp.int32)
    hidden, _ = forward(graphdef, params, jnp.asarray(tokens, jnp.int32), positions, dense_attention, None,
                        DenseMeta.single(n))
    return compute_logits(graphdef, params, hidden)


def count_params(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
