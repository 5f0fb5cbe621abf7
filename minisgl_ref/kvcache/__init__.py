"""The KV cache: memory for keys and values, the map from request rows to it, and prefix sharing (chapters 03-04)."""

from minisgl_ref.kvcache.allocator import OutOfPages, PageAllocator
from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.kvcache.radix import RadixCache
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool

__all__ = ["KVPool", "OutOfPages", "PageAllocator", "RadixCache", "ReqToTokenPool"]
