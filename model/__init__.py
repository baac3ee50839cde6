"""Model families: configuration (+ HF mapping), presets, and the NNX transformer."""

from glint.model.config import ModelConfig, RopeConfig
from glint.model.presets import PRESETS, preset

__all__ = ["PRESETS", "ModelConfig", "RopeConfig", "preset"]
