"""jhicache.cache: the two-tier (device + pinned host) radix KV cache and its page transfers."""

from jhicache.cache.copier import Copier, CudaCopier, HostCopier, make_copier
from jhicache.cache.device_pool import RESERVED_PAGES, DevicePool, PagePool, PoolLayout
from jhicache.cache.host_pool import HostPool
from jhicache.cache.invariants import InvariantError, check_invariants
from jhicache.cache.pages import PageAllocator
from jhicache.cache.radix_tree import InsertResult, MatchResult, Node, RadixTree
from jhicache.cache.ticket import LoadTicket
from jhicache.cache.tiered_cache import TieredCache
from jhicache.cache.transfer import TransferController, TransferKind, TransferOp, TransferTuning

__all__ = [
    "RESERVED_PAGES", "Copier", "CudaCopier", "DevicePool", "HostCopier", "HostPool",
    "InsertResult", "InvariantError", "LoadTicket", "MatchResult", "Node", "PageAllocator",
    "PagePool", "PoolLayout", "RadixTree", "TieredCache", "TransferController", "TransferKind",
    "TransferOp", "TransferTuning", "check_invariants", "make_copier",
]
