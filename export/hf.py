"""Hugging Face safetensors -> glint parameters, through one explicit name table per family."""
from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from safetensors import safe_open

from glint.model.config import ModelConfig

# Tensors that HF checkpoints may carry but that hold no parameters (RoPE caches).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Entry:
    """One glint parameter: the HF tensors it is made of and how to transform them.

    Several HF tensors (q/k/v, gate/up projections) are concatenated along the output axis.
    """

    hf_names: tuple[str, ...]
    path: str  # dotted glint parameter path, e.g. "layers.0.attn.wqkv.kernel"
    transpose: bool = False  # HF Linear weights are [out, in]; ours are [in, out]
    norm: bool = False  # norm weight: kept in float32, +1 when the checkpoint stores deltas
    widths: tuple[int, ...] = ()  # output width of each part when several are concatenated


def _entry(hf_name: str, path: str, **kw) -> Entry:
    return Entry((hf_name,), path, **kw)


def _layer_table(cfg: ModelConfig, i: int) -> list[Entry]:
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    attn, mlp = hf + "self_attn.", hf + "mlp."
    table = [
        _entry(hf + "input_layernorm.weight", ours + "attn_norm.weight", norm=True),
        Entry(tuple(f"{attn}{p}_proj.weight" for p in "qkv"), ours + "attn.wqkv.kernel", transpose=True,
              widths=(cfg.num_heads * cfg.head_dim,) + (cfg.num_kv_heads * cfg.head_dim,) * 2),
        _entry(attn + "o_proj.weight", ours + "attn.wo.kernel", transpose=True),
        Entry((mlp + "gate_proj.weight", mlp + "up_proj.weight"), ours + "mlp.gate_up.kernel", transpose=True,
              widths=(cfg.intermediate_size,) * 2),
        _entry(mlp + "down_proj.weight", ours + "mlp.down.kernel", transpose=True),
    ]
    if cfg.qk_norm == "rms":
        table += [_entry(attn + "q_norm.weight", ours + "attn.q_norm.weight", norm=True),
                  _entry(attn + "k_norm.weight", ours + "attn.k_norm.weight", norm=True)]
    if cfg.sandwich_norm:  # Gemma: post_attention_layernorm is the attention output's norm
        table += [_entry(hf + "post_attention_layernorm.weight", ours + "attn_post_norm.weight", norm=True),
                  _entry(hf + "pre_feedforward_layernorm.weight", ours + "mlp_norm.weight", norm=True),
                  _entry(hf + "post_feedforward_layernorm.weight", ours + "mlp_post_norm.weight", norm=True)]
    else:  # Llama: post_attention_layernorm is the MLP's input norm
        table.append(_entry(hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight", norm=True))
    return table


def name_table(cfg: ModelConfig) -> list[Entry]:
    """Every tensor a checkpoint of this config must hold."""
    if cfg.model_type not in ("llama", "mistral", "qwen3", "gemma2", "gemma3_text"):
        raise ValueError(f"no HF name table for model_type {cfg.model_type!r}")
    table = [_entry("model.embed_tokens.weight", "embed"), _entry("model.norm.weight", "norm.weight", norm=True)]
    if not cfg.tie_embeddings:
        table.append(_entry("lm_head.weight", "head.kernel", transpose=True))
    for i in range(cfg.num_layers):
        table += _layer_table(cfg, i)
    return table


def safetensors_files(hf_dir: pathlib.Path) -> list[pathlib.Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (hf_dir / n).exists()]
        if missing:
            raise ValueError(f"{index} names shard files that are not there: {missing}")
        return [hf_dir / n for n in names]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {hf_dir}")
    return files


def _open(f: pathlib.Path, framework: str = "numpy"):
    """safe_open with errors that name the file (empty, truncated or not safetensors at all)."""
    try:
        return safe_open(f, framework)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _locate(files: list[pathlib.Path]) -> dict[str, pathlib.Path]:
    where: dict[str, pathlib.Path] = {}
    for f in files:
        with _open(f) as st:
            for key in st.keys():
                if key in where:
                    raise ValueError(f"tensor {key!r} appears twice: in {where[key].name} and {f.name}")
                where[key] = f
    return where


def _read(f: pathlib.Path, key: str) -> np.ndarray:
    with _open(f, "flax") as st:  # the flax reader handles bfloat16, which numpy's does not
        try:
            return np.asarray(st.get_tensor(key))
        except Exception as e:  # data past the end of a truncated file
            raise ValueError(f"{f}: tensor {key!r} could not be read ({type(e).__name__}: {e})") from None


def read_hf(hf_dir: pathlib.Path, cfg: ModelConfig, expected_shapes: dict[str, tuple[int, ...]],
            progress=None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (glint path, array) for every tensor, checked against the table and `expected_shapes`.

    Raises ValueError naming every missing, unknown or mis-shaped tensor before yielding anything.
    """
    table = name_table(cfg)
    where = _locate(safetensors_files(hf_dir))
    wanted = {name for e in table for name in e.hf_names}
    ignored = {k for k in where if k.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_embeddings:  # some tied checkpoints also store the (identical) head
        ignored.add("lm_head.weight")
    missing = sorted(wanted - set(where))
    unknown = sorted(set(where) - wanted - ignored)
    if missing or unknown:
        raise ValueError(f"checkpoint {hf_dir} does not match {cfg.model_type} "
                         f"({cfg.num_layers} layers): missing {missing[:20]}, unknown {unknown[:20]}")
    bad = []
    for e in table:
        expected = tuple(expected_shapes[e.path])
        for name, width in zip(e.hf_names, e.widths or (expected[-1],)):
            with _open(where[name]) as st:
                stored = tuple(st.get_slice(name).get_shape())
            want = expected[:-1] + (width,)
            want = want[::-1] if e.transpose else want  # as HF stores it: [out, in] for Linear weights
            if stored != want:
                bad.append(f"{name}: stored {stored}, expected {want}")
    if bad:
        raise ValueError(f"mis-shaped tensors in {hf_dir}: " + "; ".join(bad))
    for e in table:
        parts = [_read(where[name], name) for name in e.hf_names]
        x = np.concatenate([p.T for p in parts], axis=-1) if e.transpose else np.concatenate(parts, axis=-1)
        if e.norm:
            x = x.astype(np.float32) + (1.0 if cfg.norm_delta else 0.0)
        yield e.path, x
        if progress is not None:
            progress()
