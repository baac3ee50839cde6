"""Resolve what a user names (preset, HF folder, orbax folder) into a config, parameters and tokenizer."""
from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp

from glint.export.checkpoint import GLINT_CONFIG, load_checkpoint
from glint.model import transformer
from glint.model.config import ModelConfig
from glint.model.presets import PRESETS, preset
from glint.runtime.tokenizer import load_tokenizer


def resolve_config(name_or_path: str, dtype: str | None = None, quantize: str | None = None,
                   quantize_head: bool = False) -> ModelConfig:
    def quantized(cfg):
        cfg = cfg.replace(quantize=quantize) if quantize else cfg
        return cfg.replace(quantize_head=True) if quantize_head else cfg

    if name_or_path in PRESETS:
        return quantized(preset(name_or_path, dtype=dtype or "bfloat16"))
    path = pathlib.Path(name_or_path)
    if (path / GLINT_CONFIG).exists():
        cfg = ModelConfig.from_json((path / GLINT_CONFIG).read_text())
        return cfg.replace(dtype=dtype) if dtype else cfg
    if (path / "config.json").exists():
        return quantized(ModelConfig.from_hf(path, dtype=dtype))
    raise ValueError(f"{name_or_path!r} is not a preset ({sorted(PRESETS)}) nor a checkpoint folder")


def load_model(name_or_path: str, dtype: str | None = None, seed: int = 0, quantize: str | None = None,
               quantize_head: bool = False):
    """(cfg, graphdef, params, tokenizer or None). Presets get random weights built on the device.

    `dtype` defaults to the checkpoint's own (bfloat16 for presets); `quantize` ("int8", "int4", "fp8") the
    linears' format and `quantize_head` an int8 head (a converted checkpoint keeps its own)."""
    if name_or_path in PRESETS:
        cfg = resolve_config(name_or_path, dtype, quantize, quantize_head)
        graphdef, shapes = transformer.split(transformer.abstract_model(cfg))
        return cfg, graphdef, random_params(shapes, seed), None
    cfg, params = load_checkpoint(name_or_path, dtype=dtype, quantize=quantize, quantize_head=quantize_head)
    graphdef = transformer.split(transformer.abstract_model(cfg))[0]
    return cfg, graphdef, params, load_tokenizer(pathlib.Path(name_or_path))


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key, shape, dtype):
    scale = 1.0 if len(shape) == 1 else shape[0] ** -0.5  # fan-in scaling for [in, out] kernels
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def random_params(shapes, seed: int = 0):
    """Random weights built on the device leaf by leaf (one small compile per distinct shape, not one
    giant program); float32 1-D leaves are norm weights and start at one; an int8 kernel is uniform in
    [-127, 127], and its per-channel scale gives it the fan-in scaling of a full-precision one."""
    leaves, treedef = jax.tree.flatten(shapes)
    key = jax.random.key(seed)
    out, prev = [], None
    for i, x in enumerate(leaves):
        k = jax.random.fold_in(key, i)
        if x.dtype == jnp.int8:
            value = jax.random.randint(k, x.shape, -127, 128, jnp.int32).astype(jnp.int8)
        elif x.ndim == 1 and x.dtype == jnp.float32:
            is_scale = prev is not None and prev.dtype == jnp.int8 and prev.shape[1:] == x.shape  # its kernel's
            value = jnp.full(x.shape, prev.shape[0] ** -0.5 / 73.0, x.dtype) if is_scale else jnp.ones(x.shape, x.dtype)
        else:
            value = _normal(k, x.shape, x.dtype)
        out.append(value)
        prev = x
    return jax.tree.unflatten(treedef, out)
