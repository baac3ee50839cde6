"""Pallas kernels over the paged KV state: varlen attention, ring write and the fused q/k/v write.

Each kernel file holds the kernel, its pallas_call wrapper and the public
jitted entry point; the pure-jnp references live in reference.py.
"""

from glint.pallas_kernels.qkv_write import qkv_write
from glint.pallas_kernels.reference import ring_write_reference, varlen_attention_reference
from glint.pallas_kernels.ring_write import ring_write
from glint.pallas_kernels.varlen_attention import (
    BlockSizes,
    default_block_sizes,
    default_num_splits,
    varlen_attention,
)

__all__ = [
    "BlockSizes",
    "default_block_sizes",
    "default_num_splits",
    "qkv_write",
    "ring_write",
    "ring_write_reference",
    "varlen_attention",
    "varlen_attention_reference",
]
