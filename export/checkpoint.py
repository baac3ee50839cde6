"""Checkpoints: HF folder -> orbax folder conversion, and loading from either."""
from __future__ import annotations

import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from rich.progress import Progress

from glint.export.hf import name_table, read_hf
from glint.model import quant, transformer
from glint.model.config import ModelConfig
from glint.runtime import weights

GLINT_CONFIG = "glint.json"
PARAMS_DIR = "params"
# Files copied next to the converted weights so the orbax folder is self-contained.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json")


def flatten(params) -> dict[str, jax.Array]:
    """Nested parameter dict -> {"layers.0.attn.wqkv.kernel": array}."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        flat[".".join(str(getattr(k, "key", k)) for k in path)] = leaf
    return flat


def unflatten(flat: dict[str, jax.Array], like):
    """Inverse of `flatten`, taking the tree structure from `like`."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    keys = [".".join(str(getattr(k, "key", k)) for k in path) for path, _ in paths]
    return jax.tree_util.tree_unflatten(treedef, [flat[k] for k in keys])


def abstract_params(cfg: ModelConfig):
    return transformer.split(transformer.abstract_model(cfg))[1]


def read_hf_params(hf_dir: pathlib.Path, cfg: ModelConfig, *, show_progress: bool = False) -> dict[str, np.ndarray]:
    """Flat, cast, shape-checked parameters of an HF folder."""
    like = flatten(abstract_params(cfg))
    shapes = {k: v.shape for k, v in like.items()}
    flat: dict[str, np.ndarray] = {}
    with Progress(disable=not show_progress, transient=True) as bar:
        task = bar.add_task(f"reading {hf_dir.name}", total=len(name_table(cfg)))
        for path, x in read_hf(hf_dir, cfg, shapes, progress=lambda: bar.advance(task)):
            flat[path] = np.asarray(x, dtype=like[path].dtype)
    return flat


def quantized(cfg: ModelConfig, flat: dict, quantize: str | None, group: int | None = None, head: bool = False
              ) -> tuple[ModelConfig, dict]:
    """(cfg, flat full-precision parameters) in the weight format `quantize` (None or "none": as they are);
    `group`: int4's input rows per scale (default the config's); `head`: the LM head in int8 too."""
    if quantize in (None, "none") and not head:
        return cfg, flat
    cfg = cfg.replace(quantize=quantize or "none", quant_group=cfg.quant_group if group is None else group,
                      quantize_head=head)
    return cfg, quant.quantize_params(flat, flatten(abstract_params(cfg)), cfg.quantize, cfg.quant_group)


def convert(hf_dir: str | pathlib.Path, out_dir: str | pathlib.Path, dtype: str | None = None,
            show_progress: bool = True, quantize: str | None = None, group: int | None = None,
            quantize_head: bool = False) -> ModelConfig:
    """Convert an HF checkpoint folder to an orbax folder (params/ + glint.json + side files).

    `dtype` defaults to the checkpoint's own; `quantize` ("int8", "int4", "fp8") stores the layers' linears
    quantized (the format and int4's `group` are recorded in glint.json); `quantize_head` the LM head (the tied
    embedding table too) as int8 per vocab entry."""
    hf_dir, out_dir = pathlib.Path(hf_dir), pathlib.Path(out_dir).absolute()
    if (out_dir / PARAMS_DIR).exists():  # before reading any weight
        raise ValueError(f"{out_dir / PARAMS_DIR} already exists; remove it or choose another output folder")
    cfg = ModelConfig.from_hf(hf_dir, dtype=dtype)
    cfg, flat = quantized(cfg, read_hf_params(hf_dir, cfg, show_progress=show_progress), quantize, group,
                          quantize_head)
    flat = {k: np.asarray(v) for k, v in flat.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out_dir / PARAMS_DIR, flat)
    (out_dir / GLINT_CONFIG).write_text(cfg.to_json())
    for name in SIDE_FILES:
        if (hf_dir / name).exists():
            shutil.copy(hf_dir / name, out_dir / name)
    return cfg


def load_checkpoint(path: str | pathlib.Path, dtype: str | None = None, *, show_progress: bool = False,
                    quantize: str | None = None, quantize_head: bool = False, quant_group: int | None = None,
                    place=None):
    """(ModelConfig, params) from an orbax folder written by `convert` or from an HF folder.

    `dtype` overrides the stored dtype (norm weights stay float32). `quantize` quantizes an HF folder's
    weights as they load; an orbax folder keeps the format it was converted to (ValueError if another is asked).
    `place(cfg)`: a function (name, host array) -> device array that puts each weight where it goes (tensor
    parallelism: `tp.placer`; then params is the flat dict it made); default: onto the default device.
    """
    path = pathlib.Path(path)
    if (path / GLINT_CONFIG).exists():
        try:
            cfg = ModelConfig.from_json((path / GLINT_CONFIG).read_text())
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path / GLINT_CONFIG} is not a glint model config ({type(e).__name__}: {e})") from None
        stored = flatten(abstract_params(cfg))
        if not (path / PARAMS_DIR).is_dir():
            raise ValueError(f"{path / PARAMS_DIR} is missing: the orbax checkpoint has no weights")
        if quantize not in (None, cfg.quantize):
            raise ValueError(f"{path} holds weights quantized as {cfg.quantize!r}, asked quantize={quantize!r}: "
                             f"convert the HF checkpoint again with --quantize {quantize}")
        if quant_group not in (None, cfg.quant_group) and cfg.quantize == "int4":
            raise ValueError(f"{path} holds int4 weights in groups of {cfg.quant_group}, asked quant_group="
                             f"{quant_group}: convert the HF checkpoint again with --group-size {quant_group}")
        if quantize_head and not cfg.quantize_head:
            raise ValueError(f"{path} holds a full-precision head, asked quantize_head=True: convert the HF "
                             "checkpoint again with --quantize-head")
        if dtype is not None and dtype != cfg.dtype:
            cfg = cfg.replace(dtype=dtype)
        # onto the device (or where `place` puts each), ValueErrors naming the array
        flat = weights.read_params(path / PARAMS_DIR, stored, place=None if place is None else place(cfg))
        placed = place is not None
    elif (path / "config.json").exists():
        cfg = ModelConfig.from_hf(path, dtype=dtype)
        cfg, flat = quantized(cfg, read_hf_params(path, cfg, show_progress=show_progress), quantize, quant_group,
                              head=quantize_head)
        placed = False
    elif (path / PARAMS_DIR).is_dir():
        raise ValueError(f"{path} has params/ but no {GLINT_CONFIG}: the orbax checkpoint is incomplete")
    else:
        raise ValueError(f"{path} is neither a glint (orbax) checkpoint nor an HF folder (no {GLINT_CONFIG} "
                         "or config.json)")
    like = abstract_params(cfg)
    flat_like = flatten(like)
    if placed:
        params = flat
    elif place is None:
        params = {k: jnp.asarray(v, dtype=flat_like[k].dtype) for k, v in flat.items()}
    else:
        put = place(cfg)
        params = {k: put(k, np.asarray(v)) for k, v in flat.items()}
    bad = non_finite(params)
    if bad:
        raise ValueError(f"{path}: non-finite values (NaN or inf) in {', '.join(bad[:10])}")
    return cfg, (params if place is not None else unflatten(params, like))


@jax.jit
def _all_finite(params: dict) -> dict:
    return {k: jnp.all(jnp.isfinite(v)) for k, v in params.items()}


def non_finite(params: dict[str, jax.Array]) -> list[str]:
    """Names of the flat parameters holding NaN or inf: one pass over the weights on the device."""
    return sorted(k for k, ok in jax.device_get(_all_finite(params)).items() if not ok)
