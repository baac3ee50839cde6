"""DFlash block-diffusion draft (z-lab checkpoint layout): config, weights and a pure-JAX forward.

A DFlash draft proposes `block_size - 1` tokens at once. The target's residual streams after
`target_layer_ids` are concatenated and projected (`fc`, `hidden_norm`) into one context feature per
committed token. Every draft layer is a Qwen3 decoder layer over the block ([last committed token, mask
token x (block_size - 1)], embedded by the target's table) whose attention keys and values are the
context features' (k/v projections, k_norm, RoPE at their own positions; no query, no MLP) followed by
the block's own, with no mask. The final-normed block goes through the target's LM head; the argmax of
rows 1.. is the proposal. The draft has no embedding and no head of its own.

The forward is split into pieces the engine combines with its own attention over its own cache:
`context_features` and `context_kv` (once per committed token), `draft_block` (the layer loop, attention
supplied by the caller). `dense_draft` is the one-sequence reference over a dense per-layer cache.
"""
from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from safetensors import safe_open

from glint.model.attention import softmax_attention
from glint.model.config import ModelConfig, RopeConfig, read_json_object
from glint.model.transformer import apply_rope, matmul, rms_norm, rope_table

ARCHITECTURE = "DFlashDraftModel"


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> tuple[int, ...]:
    """z-lab's choice when a checkpoint names no target_layer_ids: spread over layers 1 .. L - 3."""
    if num_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_layers - 1)) for i in range(num_layers))


@dataclass(frozen=True)
class DraftConfig:
    """Shape of a DFlash draft; frozen so it can be a static jit argument."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope: RopeConfig
    num_layers: int
    num_target_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    vocab_size: int

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_layers",
                     "num_target_layers", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2 (the last token plus at least one draft), "
                             f"got {self.block_size!r}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id!r} is not a token id of vocab_size {self.vocab_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not isinstance(i, int) or not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are out of range for num_target_layers "
                             f"{self.num_target_layers} (ids 0..{self.num_target_layers - 1})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | pathlib.Path) -> DraftConfig:
        """A DFlash config.json (dict, file or folder). `block_size` is read at the top level or inside
        `dflash_config` (newer checkpoints); the Qwen3 fields map as for a Qwen3 target. ValueError,
        naming the file, when it is not a DFlash config or lacks a field."""
        source = "config"
        if not isinstance(config, dict):
            path = pathlib.Path(config)
            file = path / "config.json" if path.is_dir() else path
            source, config = str(file), read_json_object(file)
        try:
            return _from_hf(config)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


def _from_hf(c: dict[str, Any]) -> DraftConfig:
    if ARCHITECTURE not in (c.get("architectures") or []):
        raise ValueError(f"architectures {c.get('architectures')!r} does not name {ARCHITECTURE!r}: "
                         "not a DFlash draft")
    dflash = c.get("dflash_config") or {}
    top, inner = c.get("block_size"), dflash.get("block_size")
    if top is not None and inner is not None and top != inner:
        raise ValueError(f"block_size {top} and dflash_config.block_size {inner} differ")
    block_size = top if inner is None else inner
    fields = {"block_size": block_size, "num_target_layers": c.get("num_target_layers"),
              "dflash_config.mask_token_id": dflash.get("mask_token_id")}
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(f"DFlash config lacks {missing}")
    # The draft's layers are Qwen3 decoder layers whatever target it was trained for.
    layers = ModelConfig.from_hf({**c, "model_type": "qwen3"})
    if any(layers.layer_windows):
        raise ValueError(f"sliding-window draft layers are not supported (layer_windows {layers.layer_windows})")
    num_target_layers = c["num_target_layers"]
    return DraftConfig(
        hidden_size=layers.hidden_size, num_heads=layers.num_heads, num_kv_heads=layers.num_kv_heads,
        head_dim=layers.head_dim, intermediate_size=layers.intermediate_size, norm_eps=layers.norm_eps,
        rope=layers.layer_rope[0], num_layers=layers.num_layers, num_target_layers=num_target_layers,
        block_size=block_size, mask_token_id=dflash["mask_token_id"],
        target_layer_ids=tuple(dflash.get("target_layer_ids")
                               or default_target_layer_ids(num_target_layers, layers.num_layers)),
        vocab_size=layers.vocab_size)


def check_fits(cfg: DraftConfig, target_cfg: ModelConfig) -> None:
    """ValueError unless the draft can run on this target: it reads the target's hidden states and uses its
    embedding table and LM head."""
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"draft hidden_size {cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"draft vocab_size {cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}")
    if cfg.num_target_layers != target_cfg.num_layers:
        raise ValueError(f"draft num_target_layers {cfg.num_target_layers} != target num_layers "
                         f"{target_cfg.num_layers}")
    if target_cfg.embed_scale or target_cfg.embed_norm:
        raise ValueError("the draft embeds its block with the target's raw embedding table; a "
                         f"{target_cfg.model_type} target scales or normalises its embeddings")


# Our per-layer parameters <- the z-lab tensors concatenated (along the output axis) into each.
_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm",), "wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "q_norm": ("self_attn.q_norm",), "k_norm": ("self_attn.k_norm",), "wo": ("self_attn.o_proj",),
    "mlp_norm": ("post_attention_layernorm",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def _hf_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a z-lab checkpoint of this config holds, with its stored shape (Linear: [out, in])."""
    d, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {"fc.weight": (d, len(cfg.target_layer_ids) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(cfg.num_layers):
        stored = {"input_layernorm": (d,), "post_attention_layernorm": (d,), "self_attn.q_proj": (q, d),
                  "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d), "self_attn.o_proj": (d, q),
                  "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,), "mlp.gate_proj": (ff, d),
                  "mlp.up_proj": (ff, d), "mlp.down_proj": (d, ff)}
        shapes.update({f"layers.{i}.{name}.weight": shape for name, shape in stored.items()})
    return shapes


def load_draft(folder: str | pathlib.Path, target_cfg: ModelConfig, dtype: str | None = None):
    """(DraftConfig, params) of a z-lab DFlash folder (config.json + *.safetensors), checked against the target.

    params: {"fc", "hidden_norm", "norm", "layers": [{"attn_norm", "wqkv", "q_norm", "k_norm", "wo",
    "mlp_norm", "gate_up", "down"}, ...]} of jnp arrays; matrices [in, out] in `dtype` (default: the
    target's, whose activations the draft shares), norm weights float32. ValueError naming every missing,
    unknown or mis-shaped tensor (expected and stored shape) before any is read.
    """
    folder = pathlib.Path(folder)
    cfg = DraftConfig.from_hf(folder)
    check_fits(cfg, target_cfg)
    dtype = jnp.dtype(dtype or target_cfg.dtype)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    expected = _hf_shapes(cfg)
    with contextlib.ExitStack() as stack:
        where = {}  # tensor name -> its shard's reader: one per shard (flax's handles bfloat16, numpy's does not)
        for f in files:
            st = stack.enter_context(safe_open(f, "flax"))
            where.update(dict.fromkeys(st.keys(), st))
        missing, unknown = sorted(set(expected) - set(where)), sorted(set(where) - set(expected))
        bad = [f"{name}: expected {want}, got {got}" for name, want in expected.items() if name in where
               and (got := tuple(where[name].get_slice(name).get_shape())) != want]
        if missing or unknown or bad:
            raise ValueError(f"{folder} does not match a {cfg.num_layers}-layer DFlash draft: missing {missing}, "
                             f"unknown {unknown}, mis-shaped [{'; '.join(bad)}]")

        def read(*names):
            x = jnp.concatenate([jnp.asarray(where[f"{n}.weight"].get_tensor(f"{n}.weight")) for n in names])
            return x.astype(jnp.float32) if x.ndim == 1 else x.T.astype(dtype)

        params = {name: read(name) for name in ("fc", "hidden_norm", "norm")}
        params["layers"] = [{ours: read(*(f"layers.{i}.{n}" for n in hf)) for ours, hf in _LAYER_TENSORS.items()}
                            for i in range(cfg.num_layers)]
    return cfg, params


def context_features(params, cfg: DraftConfig, tapped):
    """tapped [T, len(target_layer_ids) * hidden] (the target's `taps` features) -> context features
    [T, hidden]: fc then hidden_norm, once per committed token."""
    return rms_norm(matmul(tapped, params["fc"]), params["hidden_norm"], cfg.norm_eps)


def context_kv(params, cfg: DraftConfig, layer: int, feats, positions):
    """Keys and values of context features [T, hidden] at positions i32[T] in draft layer `layer`:
    (k, v) [T, num_kv_heads, head_dim], k normed and rotated. No layernorm: the features enter as they are."""
    p, t = params["layers"][layer], feats.shape[0]
    kv = matmul(feats, p["wqkv"][:, cfg.num_heads * cfg.head_dim:]).reshape(t, 2 * cfg.num_kv_heads, cfg.head_dim)
    k, v = jnp.split(kv, 2, axis=1)
    return apply_rope(rms_norm(k, p["k_norm"], cfg.norm_eps), rope_table(cfg.rope, cfg.head_dim, positions)), v


Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def draft_block(params, cfg: DraftConfig, block_x, positions, attend: Attend):
    """The draft's layers over block rows: block_x [T, hidden] (target embeddings of the blocks, any number
    of sequences' blocks side by side) at positions i32[T] -> final-normed hidden [T, hidden].

    attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D] gets the block rows' rotated
    queries and keys; it must let each row see its own sequence's cached context K/V (from `context_kv`)
    and its whole block, with no causal mask. The block's K/V are not kept: the next step drafts anew.
    """
    t, hq, hkv, hd = block_x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    table, eps, x = rope_table(cfg.rope, cfg.head_dim, positions), cfg.norm_eps, block_x
    for i, p in enumerate(params["layers"]):
        qkv = matmul(rms_norm(x, p["attn_norm"], eps), p["wqkv"]).reshape(t, hq + 2 * hkv, hd)
        q, k, v = jnp.split(qkv, [hq, hq + hkv], axis=1)
        q = apply_rope(rms_norm(q, p["q_norm"], eps), table)
        k = apply_rope(rms_norm(k, p["k_norm"], eps), table)
        x = x + matmul(attend(i, q, k, v).reshape(t, hq * hd), p["wo"])
        gate, up = jnp.split(matmul(rms_norm(x, p["mlp_norm"], eps), p["gate_up"]), 2, axis=-1)
        x = x + matmul(jax.nn.silu(gate) * up, p["down"])
    return rms_norm(x, params["norm"], eps)


def dense_draft(params, cfg: DraftConfig, ctx_k, ctx_v, ctx_len, block_embeds, block_positions):
    """One sequence's block through the draft over a dense cache -> final-normed hidden [block_size, hidden].

    ctx_k/ctx_v: per layer [S, Hkv, D] whose first `ctx_len` (i32 scalar) rows are every context row so far,
    the new ones included (rows past it are ignored: a fixed capacity S compiles once); block_embeds
    [block_size, hidden] at block_positions i32[block_size]. The reference the engine's paths match.
    """
    def attend(layer, q, k, v):
        keys, values = jnp.concatenate([ctx_k[layer], k]), jnp.concatenate([ctx_v[layer], v])
        # the cached context rows, then the whole block: no causal mask
        visible = jnp.concatenate([jnp.arange(ctx_k[layer].shape[0]) < ctx_len, jnp.ones(q.shape[0], bool)])
        return softmax_attention(q, keys, values, visible[None, :], scale=cfg.scale, softcap=0.0)

    return draft_block(params, cfg, block_embeds, block_positions, attend)


def flatten_params(params) -> dict:
    """The draft's params as {"draft.fc": .., "draft.layers.0.wqkv": ..}: beside the target's in one flat dict."""
    flat = {f"draft.{name}": params[name] for name in ("fc", "hidden_norm", "norm")}
    for i, layer in enumerate(params["layers"]):
        flat.update({f"draft.layers.{i}.{name}": value for name, value in layer.items()})
    return flat


def unflatten_params(flat: dict, cfg: DraftConfig) -> dict:
    """Inverse of `flatten_params` (other keys in `flat` are ignored)."""
    params = {name: flat[f"draft.{name}"] for name in ("fc", "hidden_norm", "norm")}
    params["layers"] = [{name: flat[f"draft.layers.{i}.{name}"] for name in _LAYER_TENSORS}
                        for i in range(cfg.num_layers)]
    return params


def init_draft(cfg: DraftConfig, dtype: str = "bfloat16", seed: int = 0) -> dict:
    """Random draft weights of `cfg`'s shape (benchmarks: a real draft's cost without its checkpoint);
    matrices normal with 1 / sqrt(fan-in) scale, norms 1."""
    d, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 5 * cfg.num_layers))
    dense = lambda n_in, n_out: (jax.random.normal(next(keys), (n_in, n_out), jnp.float32)  # noqa: E731
                                 * n_in ** -0.5).astype(dtype)
    ones = lambda n: jnp.ones((n,), jnp.float32)  # noqa: E731
    layers = [{"attn_norm": ones(d), "wqkv": dense(d, q + 2 * kv), "q_norm": ones(hd), "k_norm": ones(hd),
               "wo": dense(q, d), "mlp_norm": ones(d), "gate_up": dense(d, 2 * ff), "down": dense(ff, d)}
              for _ in range(cfg.num_layers)]
    return {"fc": dense(len(cfg.target_layer_ids) * d, d), "hidden_norm": ones(d), "norm": ones(d), "layers": layers}
