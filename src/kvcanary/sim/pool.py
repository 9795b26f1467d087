"""Block allocator with reference counts and a prefix cache with LRU eviction (scripted engine)."""

from __future__ import annotations

import collections


class BlockPool:
    """``num_blocks`` blocks; a block is free, owned (refcount > 0), or cached (refcount 0, evictable).

    Full blocks are registered in the prefix cache under a hash of the whole prefix they end, so
    a later request with the same prefix can share them.
    """

    def __init__(self, num_blocks: int, prefix_cache: bool = True) -> None:
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.cached: dict[int, int] = {}  # prefix hash -> block
        self.hash_of: dict[int, int] = {}  # block -> prefix hash
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, refcount 0
        self.evictions = 0
        self.hits = 0

    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def allocate(self) -> int | None:
        """A block with one more reference (1 unless an injected fault left an owned block on the free
        list: then both owners count), evicting the least recently used cached block if needed."""
        if self.free:
            b = self.free.popleft()
        elif self.lru:
            b, _ = self.lru.popitem(last=False)
            del self.cached[self.hash_of.pop(b)]
            self.evictions += 1
        else:
            return None
        self.refs[b] += 1
        return b

    def lookup(self, prefix_hash: int) -> int | None:
        """Share the cached block ending ``prefix_hash`` (refcount + 1), if there is one."""
        b = self.cached.get(prefix_hash)
        if b is None:
            return None
        self.lru.pop(b, None)
        self.refs[b] += 1
        self.hits += 1
        return b

    def register(self, block: int, prefix_hash: int) -> None:
        """Record a full block in the prefix cache (no-op if that prefix is cached already)."""
        if not self.prefix_cache or prefix_hash in self.cached or block in self.hash_of:
            return
        self.cached[prefix_hash] = block
        self.hash_of[block] = prefix_hash

    def release(self, block: int) -> None:
        """Drop one reference; an unreferenced block goes to the LRU if cached, else to the free list."""
        self.refs[block] -= 1
        assert self.refs[block] >= 0, f"block {block} released more often than taken"
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.lru[block] = None
            else:
                self.free.append(block)
