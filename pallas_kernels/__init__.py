"""Pallas kernels for paged KV: extend and decode attention (which can wait on the device for a
layer's loaded pages), and the KV write (alone, or fused with RoPE: `rope_write`); extend
attention hands a long batch's new tokens' attention among themselves to cuDNN
(`fresh_attention`). `skinny_matmul` takes a few rows through a large weight."""

# No name bound here is also a submodule's name, so `import jhicache.pallas_kernels.<module>`
# always gives the module.
from jhicache.pallas_kernels._attention import LayerGate
from jhicache.pallas_kernels.decode_attention import paged_decode_attention
from jhicache.pallas_kernels.extend_attention import paged_attention
from jhicache.pallas_kernels.kv_write import write_kv

__all__ = [
    "LayerGate",
    "paged_attention",
    "paged_decode_attention",
    "write_kv",
]
