"""Resolve what a user names (preset, HF folder, orbax folder) into a config, parameters and tokenizer."""
from __future__ import annotations

import pathlib

import jax

from glint.export.checkpoint import GLINT_CONFIG, load_checkpoint
from glint.model import transformer
from glint.model.config import ModelConfig
from glint.model.presets import PRESETS, preset


def resolve_config(name_or_path: str, dtype: str | None = None) -> ModelConfig:
    if name_or_path in PRESETS:
        return preset(name_or_path, dtype=dtype or "bfloat16")
    path = pathlib.Path(name_or_path)
    if (path / GLINT_CONFIG).exists():
        cfg = ModelConfig.from_json((path / GLINT_CONFIG).read_text())
        return cfg.replace(dtype=dtype) if dtype else cfg
    if (path / "config.json").exists():
        return ModelConfig.from_hf(path, dtype=dtype or "bfloat16")
    raise ValueError(f"{name_or_path!r} is not a preset ({sorted(PRESETS)}) nor a checkpoint folder")


def load_model(name_or_path: str, dtype: str | None = None, seed: int = 0):
    """(cfg, graphdef, params, tokenizer or None). Presets get random weights built on the device."""
    if name_or_path in PRESETS:
        cfg = resolve_config(name_or_path, dtype)
        graphdef, params = transformer.split(transformer.abstract_model(cfg))
        init = jax.jit(lambda: transformer.split(transformer.init_model(cfg, seed))[1])
        return cfg, graphdef, init(), None
    cfg, params = load_checkpoint(name_or_path, dtype=dtype)
    graphdef = transformer.split(transformer.abstract_model(cfg))[0]
    return cfg, graphdef, params, load_tokenizer(pathlib.Path(name_or_path))


def load_tokenizer(folder: pathlib.Path):
    """An HF `tokenizers` tokenizer when the folder has tokenizer.json, else None."""
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
