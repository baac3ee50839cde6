"""Paged KV cache: geometry, host bookkeeping (NumPy) and device state (jax)."""

from glint.kvcache.config import CacheConfig
from glint.kvcache.control import BatchControl, StepMetadata
from glint.kvcache.state import (
    KVState,
    apply_copies,
    default_num_pages,
    free_device_bytes,
    pad_copies,
)

__all__ = [
    "BatchControl",
    "CacheConfig",
    "KVState",
    "StepMetadata",
    "apply_copies",
    "default_num_pages",
    "free_device_bytes",
    "pad_copies",
]
