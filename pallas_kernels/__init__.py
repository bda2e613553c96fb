"""Pallas kernels for paged KV: attention, KV write, slot allocation and the page gather."""

from jhicache.pallas_kernels.kv_write import write_kv
from jhicache.pallas_kernels.page_copy import gather_pages, gather_pages_layers
from jhicache.pallas_kernels.paged_attention import paged_attention, paged_decode_attention
from jhicache.pallas_kernels.slots import alloc_decode_slots, alloc_extend_slots

__all__ = [
    "alloc_decode_slots",
    "alloc_extend_slots",
    "gather_pages",
    "gather_pages_layers",
    "paged_attention",
    "paged_decode_attention",
    "write_kv",
]
