# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Block allocator of the chunk pool, a fixed number of blocks of
`block_size` rows separate from vLLM's paged KV cache (bookkeeping only: the
worker owns the tensors). A cached segment is one entry of
cdiv(num_tokens, block_size) blocks.

* An entry with pin_count > 0 (its writer, the requests that will load it)
  is never evicted. Unpinned entries sit in an LRU list (`touch` and the
  last `unpin` make an entry the most recent); eviction frees the least
  recently used first. Free blocks go out in FIFO order (deterministic ids).
* `reserve` pins existing entries and allocates new ones in one step, or
  does nothing: an admission never undoes half of itself.
* `retire_all` (a cache reset) frees every unpinned entry and retires the
  pinned ones: freed on their last unpin, never handed to a new holder.
* `relocate` holds an entry's blocks under a holder id and gives it new ones
  (a store read given up on may still write into its rows until its call
  returns); held blocks are in no entry, never free nor evicted, until
  `release_held` (or `write_off`, which takes them out of the pool).
* The pool owns the index of its published entries (chunk_hash_index.py):
  an entry leaves it with its blocks, so the two never disagree.
"""

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from vllm.v1.core.chunk_hash_index import ChunkHashIndex
from vllm.v1.core.chunk_structures import ChunkHash, ChunkPoolEntry, PoolBlockId


class Residence(str, Enum):
    """What `ChunkBlockPool.find_bytes` knows of a key and its tokens: published
    with exactly these tokens, not published (absent, or its writer has not
    finished), or published with other tokens (a hash collision)."""

    RESIDENT = "resident"
    ABSENT = "absent"
    COLLISION = "collision"


# NOTE: `evicted` in each result: the entries evicted to make room, oldest
# first, already out of the index.


@dataclass(frozen=True)
class Reservation:
    """Result of `reserve`: the new entries in the order asked, each pinned
    once for its writer."""

    entries: tuple[ChunkPoolEntry, ...]
    evicted: tuple[ChunkHash, ...]


@dataclass(frozen=True)
class PoolAllocation:
    """Result of `allocate`: the new entry, pinned once for its writer."""

    entry: ChunkPoolEntry
    evicted: tuple[ChunkHash, ...]


@dataclass(frozen=True)
class PoolRelocation:
    """Result of `relocate`: the entry with its new blocks (pins unchanged)
    and its former blocks, now held under the holder."""

    entry: ChunkPoolEntry
    held: tuple[PoolBlockId, ...]
    evicted: tuple[ChunkHash, ...]


@dataclass(frozen=True)
class PoolUsage:
    """Snapshot of the pool's gauges and counters."""

    # Blocks not free (in entries, or held: `blocks_held`).
    blocks_used: int
    blocks_total: int
    # Entries allocated (pinned or not), and those evictable now.
    num_entries: int
    num_evictable: int
    num_evictions: int
    blocks_held: int = 0


class ChunkBlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 0 or block_size < 1:
            raise ValueError(
                f"invalid chunk pool shape num_blocks={num_blocks}, "
                f"block_size={block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_blocks: deque[PoolBlockId] = deque(
            PoolBlockId(i) for i in range(num_blocks)
        )
        self._entries: dict[ChunkHash, ChunkPoolEntry] = {}
        # Unpinned entries, least recently used first.
        self._lru: OrderedDict[ChunkHash, None] = OrderedDict()
        # Blocks of the entries in _lru (can_allocate in O(1)).
        self._evictable_blocks = 0
        # Pinned entries retired by a reset: freed on their last unpin.
        self._retired: set[ChunkHash] = set()
        # Blocks taken from entries by `relocate`, by holder.
        self._held: dict[str, tuple[PoolBlockId, ...]] = {}
        self.num_evictions = 0
        self._index = ChunkHashIndex()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def can_allocate(self, num_blocks: int) -> bool:
        """True if `num_blocks` fit after evicting unpinned entries."""
        return num_blocks <= len(self._free_blocks) + self._evictable_blocks

    def get(self, chunk_hash: ChunkHash) -> ChunkPoolEntry | None:
        return self._entries.get(chunk_hash)

    def __contains__(self, chunk_hash: object) -> bool:
        return chunk_hash in self._entries

    def is_retired(self, chunk_hash: ChunkHash) -> bool:
        return chunk_hash in self._retired

    @property
    def num_published(self) -> int:
        """Entries `find_bytes` can answer RESIDENT for."""
        return len(self._index)

    def is_published(self, chunk_hash: ChunkHash) -> bool:
        return chunk_hash in self._index

    def find_bytes(
        self, chunk_hash: ChunkHash, tokens: bytes, context: bytes
    ) -> Residence:
        """Whether `chunk_hash` is published with exactly these ids (as
        `token_bytes` serialises them)."""
        if chunk_hash not in self._index:
            return Residence.ABSENT
        if self._index.lookup_bytes(chunk_hash, tokens, context) is None:
            return Residence.COLLISION
        return Residence.RESIDENT

    @property
    def num_held_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._held.values())

    def held_by(self, holder: str) -> tuple[PoolBlockId, ...]:
        """Blocks held under `holder` (empty if none)."""
        return self._held.get(holder, ())

    def lru_order(self) -> list[ChunkHash]:
        """Evictable entries, next victim first."""
        return list(self._lru)

    def usage(self) -> PoolUsage:
        return PoolUsage(
            blocks_used=self.num_blocks - len(self._free_blocks),
            blocks_total=self.num_blocks,
            num_entries=len(self._entries),
            num_evictable=len(self._lru),
            num_evictions=self.num_evictions,
            blocks_held=self.num_held_blocks,
        )

    def allocate(self, chunk_hash: ChunkHash, num_tokens: int) -> PoolAllocation:
        """Create an entry for `num_tokens` rows, pinned once for its writer,
        evicting LRU entries if needed. ValueError if the key exists or the
        rows cannot fit even after evicting every unpinned entry."""
        if chunk_hash in self._entries:
            raise ValueError(f"chunk {chunk_hash.hex()} is already allocated")
        if num_tokens < 1:
            raise ValueError(f"cannot allocate {num_tokens} rows")
        block_ids, evicted = self._take_blocks(self.blocks_needed(num_tokens))
        entry = ChunkPoolEntry(chunk_hash, block_ids, num_tokens, pin_count=1)
        self._entries[chunk_hash] = entry
        return PoolAllocation(entry=entry, evicted=evicted)

    def reserve(
        self, pins: Sequence[ChunkHash], allocations: Sequence[tuple[ChunkHash, int]]
    ) -> Reservation | None:
        """Pin every entry of `pins` once and allocate an entry of each
        (key, num_tokens) of `allocations`, evicting LRU entries as `allocate`
        does; or, if the allocations do not fit once the pinned entries are
        out of the LRU, change nothing and return None."""
        needed = sum(self.blocks_needed(n) for _, n in allocations)
        # NOTE: entries about to be pinned leave the LRU first, so their
        # blocks are no room for the allocations.
        leaving = sum(
            len(self._entries[h].block_ids) for h in set(pins) if h in self._lru
        )
        if needed > len(self._free_blocks) + self._evictable_blocks - leaving:
            return None
        for h in pins:
            self.pin(h)
        made = [self.allocate(h, n) for h, n in allocations]
        return Reservation(
            entries=tuple(a.entry for a in made),
            evicted=tuple(v for a in made for v in a.evicted),
        )

    def publish(
        self,
        chunk_hash: ChunkHash,
        token_ids: Sequence[int],
        context_ids: Sequence[int],
        keep_pin: bool = False,
    ) -> bool:
        """The entry's writer finished: file it under its key and tokens (so
        `find_bytes` answers RESIDENT) and drop the writer's pin, or with
        `keep_pin` hand it to the caller. A retired entry is not published
        and its writer's pin always drops. True if published."""
        self._require(chunk_hash)
        if chunk_hash in self._retired:
            self.unpin(chunk_hash)
            return False
        if not keep_pin:
            self.unpin(chunk_hash)
        self._index.insert(chunk_hash, token_ids, context_ids)
        return True

    def pin(self, chunk_hash: ChunkHash) -> ChunkPoolEntry:
        entry = self._require(chunk_hash)
        if entry.pin_count == 0:
            del self._lru[chunk_hash]
            self._evictable_blocks -= len(entry.block_ids)
        entry.pin_count += 1
        return entry

    def unpin(self, chunk_hash: ChunkHash) -> None:
        entry = self._require(chunk_hash)
        if entry.pin_count == 0:
            raise ValueError(f"chunk {chunk_hash.hex()} is not pinned")
        entry.pin_count -= 1
        if entry.pin_count == 0 and chunk_hash in self._retired:
            self._retired.discard(chunk_hash)
            self._release(chunk_hash)
        elif entry.pin_count == 0:
            self._lru[chunk_hash] = None  # just used: the most recent end
            self._evictable_blocks += len(entry.block_ids)

    def unpin_all(
        self, chunk_hashes: Sequence[ChunkHash], free: ChunkHash | None = None
    ) -> None:
        """Unpin each key in order (once per pin to drop), then drop `free`
        if still there (an entry whose writer never finished)."""
        for chunk_hash in chunk_hashes:
            self.unpin(chunk_hash)
        if free is not None and free in self._entries:
            self.free(free)

    def touch(self, chunk_hash: ChunkHash) -> None:
        """Mark an entry used now (no-op on ordering while pinned)."""
        self._require(chunk_hash)
        if chunk_hash in self._lru:
            self._lru.move_to_end(chunk_hash)

    def free(self, chunk_hash: ChunkHash) -> None:
        """Drop an unpinned entry now (e.g. its writer never finished)."""
        entry = self._require(chunk_hash)
        if entry.pin_count:
            raise ValueError(
                f"chunk {chunk_hash.hex()} is pinned {entry.pin_count} time(s)"
            )
        self._release(chunk_hash)

    def retire_all(self) -> list[ChunkHash]:
        """Drop every entry: unpinned ones now, pinned ones on their last
        unpin (readable by their current holders only); none is found again.
        Returns their keys. A reset is no eviction: no counter moves."""
        dropped = list(self._entries)
        for chunk_hash in list(self._lru):
            self._release(chunk_hash)
        self._retired.update(self._entries)
        for chunk_hash in dropped:
            self._unindex(chunk_hash)
        return dropped

    def relocate(self, chunk_hash: ChunkHash, holder: str) -> PoolRelocation | None:
        """Hold a pinned entry's blocks under `holder` and give the entry new
        ones, evicting as `allocate` does; or, if they cannot fit, change
        nothing and return None. NOTE: pinned, else the entry could be the
        victim of its own relocation."""
        entry = self._require_pinned(chunk_hash, holder)
        if not self.can_allocate(len(entry.block_ids)):
            return None
        held = tuple(entry.block_ids)
        entry.block_ids, evicted = self._take_blocks(len(held))
        self._held[holder] = held
        return PoolRelocation(entry=entry, held=held, evicted=evicted)

    def release_held(self, holder: str) -> tuple[PoolBlockId, ...]:
        """Put the blocks held under `holder` back at the end of the free
        list, in row order. KeyError for an unknown holder."""
        blocks = self._pop_held(holder)
        self._free_blocks.extend(blocks)
        return blocks

    def detach(self, chunk_hash: ChunkHash, holder: str) -> tuple[PoolBlockId, ...]:
        """Drop a pinned entry (its pins with it) and hold its blocks under
        `holder`, as `relocate` would with no room for new ones."""
        entry = self._require_pinned(chunk_hash, holder)
        held = self._held[holder] = tuple(entry.block_ids)
        del self._entries[chunk_hash]
        self._retired.discard(chunk_hash)
        self._unindex(chunk_hash)
        entry.block_ids = []
        return held

    def write_off(self, holder: str) -> tuple[PoolBlockId, ...]:
        """Give up the blocks held under `holder` for good (a store call that
        never returned may still write there): num_blocks shrinks, the pool
        smaller rather than ever wrong. KeyError for an unknown holder."""
        blocks = self._pop_held(holder)
        self.num_blocks -= len(blocks)
        return blocks

    def evict_lru(self) -> ChunkHash | None:
        """Evict the least recently used unpinned entry, if any."""
        if not self._lru:
            return None
        return self._evict_lru()

    def _require(self, chunk_hash: ChunkHash) -> ChunkPoolEntry:
        entry = self._entries.get(chunk_hash)
        if entry is None:
            raise KeyError(f"chunk {chunk_hash.hex()} is not in the pool")
        return entry

    def _require_pinned(self, chunk_hash: ChunkHash, holder: str) -> ChunkPoolEntry:
        entry = self._require(chunk_hash)
        if not entry.pin_count:
            raise ValueError(f"chunk {chunk_hash.hex()} is not pinned")
        if holder in self._held:
            raise ValueError(f"holder {holder} already holds pool blocks")
        return entry

    def _pop_held(self, holder: str) -> tuple[PoolBlockId, ...]:
        blocks = self._held.pop(holder, None)
        if blocks is None:
            raise KeyError(f"holder {holder} holds no pool blocks")
        return blocks

    def _take_blocks(
        self, num_blocks: int
    ) -> tuple[list[PoolBlockId], tuple[ChunkHash, ...]]:
        """`num_blocks` free blocks and the entries evicted for room; raises
        ValueError, changing nothing, if they cannot fit."""
        if not self.can_allocate(num_blocks):
            raise ValueError(
                f"chunk pool cannot hold {num_blocks} blocks: "
                f"{len(self._free_blocks)} free, "
                f"{self._evictable_blocks} evictable of {self.num_blocks}"
            )
        evicted = []
        while len(self._free_blocks) < num_blocks:
            evicted.append(self._evict_lru())
        return [self._free_blocks.popleft() for _ in range(num_blocks)], tuple(evicted)

    def _evict_lru(self) -> ChunkHash:
        victim = next(iter(self._lru))
        self._release(victim)
        self.num_evictions += 1
        return victim

    def _unindex(self, chunk_hash: ChunkHash) -> None:
        if chunk_hash in self._index:
            self._index.remove(chunk_hash)

    def _release(self, chunk_hash: ChunkHash) -> None:
        self._unindex(chunk_hash)
        entry = self._entries.pop(chunk_hash)
        if self._lru.pop(chunk_hash, False) is None:
            self._evictable_blocks -= len(entry.block_ids)
        self._free_blocks.extend(entry.block_ids)
        entry.block_ids = []
