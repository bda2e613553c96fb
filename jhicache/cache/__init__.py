"""jhicache.cache: the two-tier (device + pinned host) radix KV cache and its page transfers;
`CacheTiers.build` makes them, for our engine or one with its own model and loop."""

from jhicache.cache.cache_tiers import CacheTiers
from jhicache.cache.copier import Copier, CudaCopier, HostCopier, make_copier
from jhicache.cache.device_pool import RESERVED_PAGES, DevicePool, PagePool, PoolLayout
from jhicache.cache.host_pool import HostPool
from jhicache.cache.invariants import InvariantError, check_invariants
from jhicache.cache.pages import PageAllocator
from jhicache.cache.prefix_cache import PrefixCache
from jhicache.cache.radix_tree import InsertResult, MatchResult, Node, RadixTree
from jhicache.cache.step import TransferStep
from jhicache.cache.ticket import LoadTicket
from jhicache.cache.tiers import DeviceTier, HostTier, Tier
from jhicache.cache.transfer_op import TransferKind, TransferOp
from jhicache.cache.transfers import Transfers

__all__ = [
    "RESERVED_PAGES", "CacheTiers", "Copier", "CudaCopier", "DevicePool", "DeviceTier",
    "HostCopier", "HostPool", "HostTier", "InsertResult", "InvariantError", "LoadTicket",
    "MatchResult", "Node", "PageAllocator", "PagePool", "PoolLayout", "PrefixCache", "RadixTree",
    "Tier", "TransferKind", "TransferOp", "TransferStep", "Transfers", "check_invariants",
    "make_copier",
]
