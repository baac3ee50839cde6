"""Resolve what a user names (preset, HF folder, orbax folder) into a config, parameters and tokenizer."""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from glint.export.checkpoint import GLINT_CONFIG, load_checkpoint
from glint.model import tp, transformer
from glint.model.config import ModelConfig
from glint.model.presets import PRESETS, preset
from glint.runtime.tokenizer import load_tokenizer


def resolve_config(name_or_path: str, dtype: str | None = None, quantize: str | None = None,
                   quantize_head: bool = False, quant_group: int | None = None) -> ModelConfig:
    def quantized(cfg):
        cfg = cfg.replace(quantize=quantize) if quantize else cfg
        cfg = cfg.replace(quant_group=quant_group) if quant_group is not None else cfg
        return cfg.replace(quantize_head=True) if quantize_head else cfg

    if name_or_path in PRESETS:
        return quantized(preset(name_or_path, dtype=dtype or "bfloat16"))
    from glint.runtime.artifact import METADATA

    path = pathlib.Path(name_or_path)
    if (path / METADATA).exists():  # an exported artifact: the config it was exported with
        model = json.loads((path / METADATA).read_text())["model"]
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        cfg = ModelConfig.from_json(json.dumps({k: v for k, v in model.items() if k in known}))
        return cfg.replace(dtype=dtype) if dtype else cfg
    if (path / GLINT_CONFIG).exists():
        cfg = ModelConfig.from_json((path / GLINT_CONFIG).read_text())
        return cfg.replace(dtype=dtype) if dtype else cfg
    if (path / "config.json").exists():
        return quantized(ModelConfig.from_hf(path, dtype=dtype))
    raise ValueError(f"{name_or_path!r} is not a preset ({sorted(PRESETS)}) nor a checkpoint folder")


def load_model(name_or_path: str, dtype: str | None = None, seed: int = 0, quantize: str | None = None,
               quantize_head: bool = False, quant_group: int | None = None, tensor_parallel: int = 1):
    """(cfg, graphdef, params, tokenizer or None). Presets get random weights built on the device.

    `dtype` defaults to the checkpoint's own (bfloat16 for presets); `quantize` ("int8", "int4", "fp8") the
    linears' format and `quantize_head` an int8 head (a converted checkpoint keeps its own). With
    `tensor_parallel` N > 1 the params are the flat dict of global arrays on the N-device mesh (model/tp.py),
    each device's shard copied to it alone; a preset's random weights are the ones of N = 1, each leaf drawn whole on
    every device (one leaf at a time), then cut into its shards there."""
    n = tensor_parallel
    if name_or_path in PRESETS:
        cfg = resolve_config(name_or_path, dtype, quantize, quantize_head, quant_group)
        graphdef, shapes = transformer.split(transformer.abstract_model(cfg))
        if n == 1:
            return cfg, graphdef, random_params(shapes, seed), None
        tp.check(cfg, n)  # the same random model as on one device, each leaf drawn whole on every device, then split
        targets = tp.global_shapes(cfg, n, local_like(cfg, n))
        replicated = NamedSharding(tp.mesh(n), PartitionSpec())
        params = random_params(shapes, seed, sharding=replicated,
                               finish=lambda name, x: tp.relayout(cfg, n, name, x, targets[name].sharding))
        return cfg, graphdef, params, None
    place = None
    if n > 1:
        tp.check(resolve_config(name_or_path, dtype, quantize, quantize_head, quant_group), n)
        place = lambda cfg: tp.placer(cfg, n, local_like(cfg, n))  # noqa: E731
    cfg, params = load_checkpoint(name_or_path, dtype=dtype, quantize=quantize, quantize_head=quantize_head,
                                  quant_group=quant_group, place=place)
    graphdef = transformer.split(transformer.abstract_model(cfg))[0]
    return cfg, graphdef, params, load_tokenizer(pathlib.Path(name_or_path))


def local_like(cfg: ModelConfig, n: int) -> dict:
    """Flat shapes of one device's shard of the model over `n` devices (model/tp.py)."""
    from glint.export.checkpoint import flatten

    return flatten(transformer.split(transformer.abstract_model(tp.local_config(cfg, n)))[1])


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key, shape, dtype):
    scale = 1.0 if len(shape) == 1 else shape[0] ** -0.5  # fan-in scaling for [in, out] kernels
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


@functools.lru_cache(maxsize=None)
def _drawer(kind: str, shape: tuple, dtype, sharding):
    """(key, fill) -> a random leaf of `kind` ("normal", "quantized", "full"), built in `sharding` (each device
    draws its own shard; None: where jax puts it). One compile per distinct leaf kind, shape and sharding."""
    like = jax.ShapeDtypeStruct(shape, dtype)
    draw = {"normal": lambda key, fill: _normal(key, shape, dtype),
            "quantized": lambda key, fill: _random_quantized(key, like),
            "full": lambda key, fill: jnp.full(shape, fill, dtype)}[kind]
    return jax.jit(draw, **({} if sharding is None else {"out_shardings": sharding}))


# Spread (std) of a random quantized value: int8 uniform in [-127, 127], an int4 nibble uniform in [-8, 7], fp8
# normal with std 64; its scale divides it out, so a dequantized kernel has the fan-in scaling of a full one.
_SPREAD = {jnp.dtype(jnp.int8): 73.3, jnp.dtype(jnp.uint8): 4.61, jnp.dtype(jnp.float8_e4m3fn): 64.0}


def _random_quantized(key, x):
    if x.dtype == jnp.int8:
        return jax.random.randint(key, x.shape, -127, 128, jnp.int32).astype(jnp.int8)
    if x.dtype == jnp.uint8:  # int4, two nibbles per byte
        return jax.random.randint(key, x.shape, 0, 256, jnp.int32).astype(jnp.uint8)
    return jnp.clip(jax.random.normal(key, x.shape) * 64.0, -448, 448).astype(x.dtype)


def random_params(shapes, seed: int = 0, sharding=None, finish=None):
    """Random weights built on the device leaf by leaf (one small compile per distinct shape, not one
    giant program); float32 1-D leaves are norm weights and start at one; quantized weights (model/quant.py:
    "<linear>.qweight", a tied int8 head's "embed_q") are uniform or normal in their format's range, and their
    scales give the dequantized kernel the fan-in scaling of a full-precision one. Each leaf is drawn in
    `sharding` (default: where jax puts it), then passed through `finish(name, leaf)` when given (tensor
    parallelism: split into its shards) before the next is drawn."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    leaves = {".".join(str(getattr(k, "key", k)) for k in path): x for path, x in paths}
    key = jax.random.key(seed)
    out = []
    for i, (name, x) in enumerate(leaves.items()):
        k = jax.random.fold_in(key, i)
        base, _, field = name.rpartition(".")
        quantized = "embed_q" if name == "embed_scale" else f"{base}.qweight" if field == "scale" else None
        fill = 0.0
        if name == "embed_q" or field == "qweight":
            kind = "quantized"
        elif quantized in leaves:
            q = leaves[quantized]
            fan_in = q.shape[1] * (2 if q.dtype == jnp.uint8 else 1)  # [out, in] (int4: two rows per byte)
            kind, fill = "full", fan_in ** -0.5 / _SPREAD[jnp.dtype(q.dtype)]
        elif x.ndim == 1 and x.dtype == jnp.float32:
            kind, fill = "full", 1.0
        else:
            kind = "normal"
        value = _drawer(kind, tuple(x.shape), jnp.dtype(x.dtype), sharding)(k, fill)
        out.append(value if finish is None else finish(name, value))
    return jax.tree.unflatten(treedef, out)
