"""HF safetensors -> orbax conversion, loading from either, and `export_engine` (the exported artifact)."""

from glint.export.checkpoint import convert, load_checkpoint
from glint.export.exporter import export_engine

__all__ = ["convert", "export_engine", "load_checkpoint"]
