# SPDX-License-Identifier: Apache-2.0
"""Block allocator of the chunk pool (the spec's independent 15% pool).

The pool is a fixed number of blocks of `block_size` rows, separate from
vLLM's paged KV cache. A cached segment is one entry made of
cdiv(num_tokens, block_size) blocks. This class only does the bookkeeping
(which block belongs to which entry); the worker owns the tensors.

Rules:
* An entry with pin_count > 0 is never evicted. Pins are taken by the
  child request writing the entry and by every request that will load it.
* Unpinned entries sit in an LRU list; `touch` and the last `unpin` move an
  entry to the most-recently-used end. Eviction frees exactly the least
  recently used unpinned entry, then the next, until the request fits.
* Free blocks are handed out in FIFO order (lowest ids first on a fresh
  pool; freed blocks go to the back), which keeps block ids deterministic.
* `retire_all` (a cache reset: new weights, sleep) frees every unpinned
  entry now and retires the pinned ones: a retired entry is freed when its
  last pin drops instead of entering the LRU, so its rows (old weights, or
  memory a sleep discarded) are never handed to a new holder.
* `relocate` takes an entry's blocks away into the held set under a holder
  id and gives the entry new ones (issue 39, finding 9: a store read given
  up on may still write into its rows until the store's call returns).
  Held blocks are in no entry, never free, never evicted and untouched by
  `retire_all`; `release_held` puts them back on the free list.
* `reserve` pins existing entries and allocates new ones in one step, or
  does nothing at all: an admission never has to undo half of itself.
* The pool owns the index of its resident entries (key -> exact tokens,
  chunk_hash_index.py): `publish` files an entry whose writer finished,
  `find` answers by key and tokens, and an entry evicted, freed or retired
  leaves the index with its blocks, so the two never disagree.
"""

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from vllm.v1.core.chunk_hash_index import ChunkHashIndex
from vllm.v1.core.chunk_structures import ChunkHash, ChunkPoolEntry, PoolBlockId


class Residence(str, Enum):
    """What `ChunkBlockPool.find` knows of a key and its tokens."""

    # Published under this key with exactly these tokens.
    RESIDENT = "resident"
    # Not published (absent, or an entry whose writer has not finished).
    ABSENT = "absent"
    # Published under this key with other tokens: a hash collision.
    COLLISION = "collision"


@dataclass(frozen=True)
class Reservation:
    """Result of `ChunkBlockPool.reserve`."""

    # The new entries, in the order asked, each pinned once (for its writer).
    entries: tuple[ChunkPoolEntry, ...]
    # Entries evicted to make room, oldest first (already out of the index).
    evicted: tuple[ChunkHash, ...]


@dataclass(frozen=True)
class PoolAllocation:
    """Result of `ChunkBlockPool.allocate`."""

    # The new entry, already pinned once for its writer.
    entry: ChunkPoolEntry
    # Entries evicted to make room, oldest first (already out of the index).
    evicted: tuple[ChunkHash, ...]


@dataclass(frozen=True)
class PoolRelocation:
    """Result of `ChunkBlockPool.relocate`."""

    # The entry with its new blocks (pins unchanged).
    entry: ChunkPoolEntry
    # The entry's former blocks, now held under the holder.
    held: tuple[PoolBlockId, ...]
    # Entries evicted to make room, oldest first (already out of the index).
    evicted: tuple[ChunkHash, ...]


@dataclass(frozen=True)
class PoolUsage:
    """Snapshot of the pool's gauges and counters."""

    # Blocks owned by entries.
    blocks_used: int
    # Blocks in the pool.
    blocks_total: int
    # Entries currently allocated (pinned or not).
    num_entries: int
    # Entries that can be evicted right now.
    num_evictable: int
    # Entries evicted since creation.
    num_evictions: int
    # Blocks held for a holder (`relocate`), in no entry; counted in
    # blocks_used too (they are not free).
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
        # Unpinned entries, least recently used first. Values unused.
        self._lru: OrderedDict[ChunkHash, None] = OrderedDict()
        # Blocks held by entries in _lru (kept to answer can_allocate in O(1)).
        self._evictable_blocks = 0
        # Pinned entries retired by a reset: freed on their last unpin.
        self._retired: set[ChunkHash] = set()
        # Blocks taken from entries by `relocate`, per holder, until
        # `release_held`.
        self._held: dict[str, tuple[PoolBlockId, ...]] = {}
        self.num_evictions = 0
        # Resident entries' exact tokens, by key (`publish`, `find`).
        self._index = ChunkHashIndex()
        # Blocks given up for good (`write_off`): no longer in num_blocks.
        self.num_written_off = 0

    # ------------------------------------------------------------- queries

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
        """Entries `find` can answer RESIDENT for."""
        return len(self._index)

    def is_published(self, chunk_hash: ChunkHash) -> bool:
        return chunk_hash in self._index

    def find(
        self,
        chunk_hash: ChunkHash,
        token_ids: Sequence[int],
        context_ids: Sequence[int],
    ) -> Residence:
        """Whether `chunk_hash` is published with exactly these tokens."""
        if chunk_hash not in self._index:
            return Residence.ABSENT
        if self._index.lookup(chunk_hash, token_ids, context_ids) is None:
            return Residence.COLLISION
        return Residence.RESIDENT

    def find_bytes(
        self, chunk_hash: ChunkHash, tokens: bytes, context: bytes
    ) -> Residence:
        """`find` of ids already serialised by `token_bytes` (issue 52)."""
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

    # ----------------------------------------------------------- mutations

    def allocate(self, chunk_hash: ChunkHash, num_tokens: int) -> PoolAllocation:
        """Create an entry for `num_tokens` rows, evicting LRU if needed.

        The entry comes back pinned once (for the writer). Raises
        ValueError if the key exists or if the rows cannot fit even after
        evicting every unpinned entry (check `can_allocate` first).
        """
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
        # NOTE: entries about to be pinned leave the LRU first, so their blocks
        # are no room for the allocations (as when pinned one by one before).
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
        """The entry's writer finished: file it under its key and tokens, so
        that `find` answers RESIDENT, and drop the writer's pin, or, with
        `keep_pin`, hand it to the caller (to drop with `unpin`). A retired
        entry (computed before a reset: never found again) is not published
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
            # NOTE: the last holder just used it, so it enters the LRU at
            # the most-recently-used end.
            self._lru[chunk_hash] = None
            self._evictable_blocks += len(entry.block_ids)

    def unpin_all(
        self, chunk_hashes: Sequence[ChunkHash], free: ChunkHash | None = None
    ) -> None:
        """Unpin each key in order (a key once per pin to drop), then drop
        `free` if it is still there (an entry whose writer never finished; a
        retired one went with its last pin)."""
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
        unpin (they stay readable for their current holders only). Returns
        the keys of all entries that existed (none of them is found again).
        Eviction counters are not touched: a reset is no eviction."""
        dropped = list(self._entries)
        for chunk_hash in list(self._lru):
            self._release(chunk_hash)
        self._retired.update(self._entries)
        for chunk_hash in dropped:
            self._unindex(chunk_hash)
        return dropped

    def relocate(self, chunk_hash: ChunkHash, holder: str) -> PoolRelocation | None:
        """Hold a pinned entry's blocks under `holder` and give the entry new
        ones, evicting LRU entries as `allocate` does; or, if the new blocks
        do not fit even after evicting every unpinned entry, change nothing
        and return None."""
        entry = self._require(chunk_hash)
        if not entry.pin_count:
            # NOTE: an unpinned entry is in the LRU and could be chosen as the
            # victim of its own relocation; every caller holds a writer's pin.
            raise ValueError(f"chunk {chunk_hash.hex()} is not pinned")
        if holder in self._held:
            raise ValueError(f"holder {holder} already holds pool blocks")
        if not self.can_allocate(len(entry.block_ids)):
            return None
        held = tuple(entry.block_ids)
        entry.block_ids, evicted = self._take_blocks(len(held))
        self._held[holder] = held
        return PoolRelocation(entry=entry, held=held, evicted=evicted)

    def release_held(self, holder: str) -> tuple[PoolBlockId, ...]:
        """Put the blocks held under `holder` back on the free list (at its
        back, in their row order). Raises KeyError for an unknown holder."""
        blocks = self._held.pop(holder, None)
        if blocks is None:
            raise KeyError(f"holder {holder} holds no pool blocks")
        self._free_blocks.extend(blocks)
        return blocks

    def detach(self, chunk_hash: ChunkHash, holder: str) -> tuple[PoolBlockId, ...]:
        """Drop a pinned entry (its pins with it) and hold its blocks under
        `holder` instead, as `relocate` would with no room for new ones."""
        entry = self._require(chunk_hash)
        if not entry.pin_count:
            raise ValueError(f"chunk {chunk_hash.hex()} is not pinned")
        if holder in self._held:
            raise ValueError(f"holder {holder} already holds pool blocks")
        held = self._held[holder] = tuple(entry.block_ids)
        del self._entries[chunk_hash]
        self._retired.discard(chunk_hash)
        self._unindex(chunk_hash)
        entry.block_ids = []
        return held

    def write_off(self, holder: str) -> tuple[PoolBlockId, ...]:
        """Give up the blocks held under `holder` for good: they leave the pool
        (num_blocks shrinks) and are never handed out again. Raises KeyError for
        an unknown holder.

        NOTE (issue 50, finding 4): for rows a store call that never returned
        may still write into; the pool is smaller rather than ever wrong."""
        blocks = self._held.pop(holder, None)
        if blocks is None:
            raise KeyError(f"holder {holder} holds no pool blocks")
        self.num_blocks -= len(blocks)
        self.num_written_off += len(blocks)
        return blocks

    def evict_lru(self) -> ChunkHash | None:
        """Evict the least recently used unpinned entry, if any."""
        if not self._lru:
            return None
        return self._evict_lru()

    # ------------------------------------------------------------ internal

    def _require(self, chunk_hash: ChunkHash) -> ChunkPoolEntry:
        entry = self._entries.get(chunk_hash)
        if entry is None:
            raise KeyError(f"chunk {chunk_hash.hex()} is not in the pool")
        return entry

    def _take_blocks(
        self, num_blocks: int
    ) -> tuple[list[PoolBlockId], tuple[ChunkHash, ...]]:
        """`num_blocks` free blocks, evicting LRU entries for room (those
        evicted, oldest first); raises ValueError, changing nothing, if they
        cannot fit even after evicting every unpinned entry."""
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
