"""HF safetensors -> orbax conversion, and loading from either."""

from glint.export.checkpoint import convert, load_checkpoint

__all__ = ["convert", "load_checkpoint"]
