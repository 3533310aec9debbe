"""Device-side KV formats and the paged KV pool (8.1, 8.3.1, 8.4.2)."""
from pallas_kernels.kv_codec import FORMATS, KVFormat, gather_pages, get_format
from jaxinfer.kv.pool import (KVLayout, KVPool, allocate_pool, bytes_per_token, copy_pages,
                              grouped_layout, kv_layout, page_bytes, pool_bytes, write_tokens)

__all__ = ["FORMATS", "KVFormat", "get_format", "KVLayout", "KVPool", "allocate_pool",
           "bytes_per_token", "copy_pages", "gather_pages", "grouped_layout", "kv_layout",
           "page_bytes", "pool_bytes", "write_tokens"]
