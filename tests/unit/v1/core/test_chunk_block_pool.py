# SPDX-License-Identifier: Apache-2.0
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)
from vllm.v1.core.chunk_block_pool import ChunkBlockPool
from vllm.v1.core.chunk_structures import ChunkHash


def key(i: int) -> ChunkHash:
    return ChunkHash(i.to_bytes(16, "little"))


def test_retire_all_frees_unpinned_now_and_pinned_on_their_last_unpin():
    pool = ChunkBlockPool(num_blocks=8, block_size=4)
    pool.allocate(key(1), 4)
    pool.unpin(key(1))  # resident, unpinned
    pool.allocate(key(2), 8)  # pinned by its writer
    pool.pin(key(2))  # and by a reader
    assert pool.retire_all() == [key(1), key(2)]
    assert key(1) not in pool and pool.is_retired(key(2))
    assert pool.usage().blocks_used == 2 and pool.usage().num_evictable == 0
    assert pool.evict_lru() is None  # a retired entry is never an LRU victim
    pool.unpin(key(2))
    assert key(2) in pool  # still read by its other holder
    pool.unpin(key(2))
    assert key(2) not in pool and not pool.is_retired(key(2))
    assert pool.usage().blocks_used == 0 and pool.num_evictions == 0
    # The key can be allocated again (new rows).
    assert pool.allocate(key(2), 4).entry.block_ids == [3]


def test_fresh_pool_hands_out_lowest_blocks_first():
    pool = ChunkBlockPool(num_blocks=8, block_size=4)
    a = pool.allocate(key(1), 5)  # 2 blocks
    b = pool.allocate(key(2), 4)  # 1 block
    assert a.entry.block_ids == [0, 1]
    assert b.entry.block_ids == [2]
    assert a.evicted == () and b.evicted == ()
    assert a.entry.pin_count == 1  # the writer's pin
    assert pool.usage().blocks_used == 3
    assert pool.num_free_blocks == 5


def test_blocks_needed_rounds_up():
    pool = ChunkBlockPool(num_blocks=4, block_size=16)
    assert [pool.blocks_needed(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


def test_eviction_is_exact_lru_and_skips_pinned():
    pool = ChunkBlockPool(num_blocks=4, block_size=2)
    for i in range(4):
        pool.allocate(key(i), 2)
    # Unpin in the order 2, 0, 3 -> LRU order 2, 0, 3; entry 1 stays pinned.
    for i in (2, 0, 3):
        pool.unpin(key(i))
    assert pool.lru_order() == [key(2), key(0), key(3)]
    pool.touch(key(2))  # a hit: 2 becomes most recent
    assert pool.lru_order() == [key(0), key(3), key(2)]

    alloc = pool.allocate(key(10), 4)  # needs 2 blocks -> evict 0 then 3
    assert alloc.evicted == (key(0), key(3))
    assert alloc.entry.block_ids == [0, 3]  # freed blocks in eviction order
    assert key(1) in pool and key(2) in pool
    assert pool.num_evictions == 2

    assert not pool.can_allocate(2)  # only entry 2 (1 block) is evictable
    with pytest.raises(ValueError, match="cannot hold 2 blocks"):
        pool.allocate(key(11), 3)
    assert key(2) in pool  # a refused allocation evicts nothing


def test_pin_removes_from_lru_and_last_unpin_makes_most_recent():
    pool = ChunkBlockPool(num_blocks=3, block_size=1)
    for i in range(3):
        pool.allocate(key(i), 1)
        pool.unpin(key(i))
    pool.pin(key(0))
    pool.pin(key(0))
    assert pool.lru_order() == [key(1), key(2)]
    assert pool.usage().num_evictable == 2
    pool.unpin(key(0))
    assert pool.lru_order() == [key(1), key(2)]  # still pinned once
    pool.touch(key(0))  # no effect while pinned
    pool.unpin(key(0))
    assert pool.lru_order() == [key(1), key(2), key(0)]
    assert pool.evict_lru() == key(1)
    assert pool.evict_lru() == key(2)
    assert pool.evict_lru() == key(0)
    assert pool.evict_lru() is None
    assert pool.num_free_blocks == 3


def test_free_and_errors():
    pool = ChunkBlockPool(num_blocks=2, block_size=4)
    pool.allocate(key(1), 3)
    with pytest.raises(ValueError, match="already allocated"):
        pool.allocate(key(1), 3)
    with pytest.raises(ValueError, match="pinned 1 time"):
        pool.free(key(1))
    pool.unpin(key(1))
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin(key(1))
    pool.free(key(1))
    with pytest.raises(KeyError):
        pool.free(key(1))  # no double free
    with pytest.raises(KeyError):
        pool.pin(key(1))
    with pytest.raises(KeyError):
        pool.touch(key(1))
    with pytest.raises(ValueError, match="cannot allocate 0 rows"):
        pool.allocate(key(2), 0)
    with pytest.raises(ValueError, match="invalid chunk pool shape"):
        ChunkBlockPool(num_blocks=4, block_size=0)
    assert pool.get(key(1)) is None
    assert pool.usage().blocks_used == 0


def test_relocate_holds_the_old_blocks_and_gives_new_ones_evicting_lru():
    pool = ChunkBlockPool(num_blocks=6, block_size=2)
    pool.allocate(key(1), 2)  # [0]
    pool.unpin(key(1))
    pool.allocate(key(2), 4)  # [1, 2], pinned by its writer
    pool.pin(key(2))  # and by a waiting reader
    pool.allocate(key(3), 2)  # [3]
    pool.unpin(key(3))  # LRU: 1, 3; free: 4, 5
    moved = pool.relocate(key(2), holder="fetch-a")
    assert moved.held == (1, 2)
    assert moved.entry is pool.get(key(2))
    assert moved.entry.block_ids == [4, 5] and moved.entry.pin_count == 2
    assert moved.evicted == ()
    assert pool.held_by("fetch-a") == (1, 2)
    usage = pool.usage()
    assert (usage.blocks_used, usage.blocks_held) == (6, 2)  # held is not free
    # Nothing free now: a second relocation evicts the LRU entries, oldest first.
    pool.allocate(key(4), 4)  # evicts 1 and 3 -> [0, 3]
    pool.unpin(key(4))
    moved = pool.relocate(key(2), holder="fetch-b")
    assert moved.evicted == (key(4),)
    assert moved.held == (4, 5) and moved.entry.block_ids == [0, 3]
    assert pool.num_free_blocks == 0 and pool.num_held_blocks == 4
    # Held blocks are never evicted, never retired, never allocated.
    assert pool.evict_lru() is None
    assert pool.retire_all() == [key(2)]
    assert pool.held_by("fetch-a") == (1, 2) and pool.held_by("fetch-b") == (4, 5)
    assert not pool.can_allocate(1)
    # Released: back on the free list in row order, handed out after the rest.
    assert pool.release_held("fetch-b") == (4, 5)
    assert pool.release_held("fetch-a") == (1, 2)
    assert list(pool._free_blocks) == [4, 5, 1, 2]
    assert pool.usage().blocks_held == 0 and pool.usage().blocks_used == 2
    pool.unpin(key(2))
    pool.unpin(key(2))  # retired: freed on its last pin, the new blocks only
    assert list(pool._free_blocks) == [4, 5, 1, 2, 0, 3]


def test_relocate_without_room_changes_nothing():
    pool = ChunkBlockPool(num_blocks=4, block_size=2)
    pool.allocate(key(1), 4)  # [0, 1], pinned
    pool.allocate(key(2), 2)  # [2], pinned
    pool.allocate(key(3), 2)  # [3]
    pool.unpin(key(3))  # evictable, but 1 block is not enough for 2
    assert not pool.can_allocate(2)
    assert pool.relocate(key(1), holder="fetch-a") is None
    assert pool.get(key(1)).block_ids == [0, 1] and pool.get(key(1)).pin_count == 1
    assert key(3) in pool and pool.held_by("fetch-a") == ()  # nothing evicted in vain
    usage = pool.usage()
    assert (usage.blocks_used, usage.blocks_held, usage.num_entries) == (4, 0, 3)


def test_relocate_of_a_retired_entry_keeps_it_retired():
    pool = ChunkBlockPool(num_blocks=4, block_size=2)
    pool.allocate(key(1), 2)  # [0]
    pool.retire_all()
    moved = pool.relocate(key(1), holder="fetch-a")
    assert moved.entry.block_ids == [1] and pool.is_retired(key(1))
    pool.unpin(key(1))
    assert key(1) not in pool
    assert list(pool._free_blocks) == [2, 3, 1]  # block 0 is still held
    # Without room: refused, still retired and pinned.
    pool.allocate(key(2), 6)  # [2, 3, 1]
    pool.retire_all()
    assert pool.relocate(key(2), holder="fetch-b") is None
    assert pool.is_retired(key(2)) and pool.get(key(2)).block_ids == [2, 3, 1]
    assert pool.usage().blocks_held == 1 and pool.num_free_blocks == 0


def test_relocate_and_release_errors():
    pool = ChunkBlockPool(num_blocks=4, block_size=2)
    pool.allocate(key(1), 2)
    pool.unpin(key(1))
    with pytest.raises(ValueError, match="not pinned"):
        pool.relocate(key(1), holder="fetch-a")  # could evict itself
    pool.pin(key(1))
    pool.relocate(key(1), holder="fetch-a")
    with pytest.raises(ValueError, match="already holds"):
        pool.relocate(key(1), holder="fetch-a")
    with pytest.raises(KeyError):
        pool.relocate(key(9), holder="fetch-b")
    pool.release_held("fetch-a")
    with pytest.raises(KeyError, match="holds no pool blocks"):
        pool.release_held("fetch-a")  # no double release
    assert pool.held_by("fetch-a") == ()


def test_reserve_pins_and_allocates_all_or_nothing():
    """Issue 51: an admission's pins and allocations in one step. Entries to be
    pinned leave the LRU first, so they are no room for the allocations."""
    from vllm.v1.core.chunk_block_pool import Reservation

    pool = ChunkBlockPool(num_blocks=4, block_size=2)
    for i in range(3):
        pool.allocate(key(i), 2)
        pool.unpin(key(i))  # three resident entries, LRU order 0, 1, 2
    # Pin 0 and 1, allocate 3 blocks: only 2 is evictable (1 block) + 1 free.
    assert pool.reserve([key(0), key(1)], [(key(5), 5)]) is None
    assert pool.lru_order() == [key(0), key(1), key(2)]  # nothing changed
    assert pool.usage().num_evictable == 3 and pool.num_evictions == 0
    got = pool.reserve([key(0), key(1)], [(key(5), 2), (key(6), 1)])
    assert isinstance(got, Reservation) and got.evicted == (key(2),)
    assert [e.chunk_hash for e in got.entries] == [key(5), key(6)]
    assert [pool.get(k).pin_count for k in (key(0), key(1), key(5), key(6))] == [
        1,
        1,
        1,
        1,
    ]
    assert pool.lru_order() == []


def test_the_index_is_the_pools_own_an_evicted_entry_leaves_it():
    from vllm.v1.core.chunk_block_pool import Residence
    from vllm.v1.core.chunk_hash_index import token_bytes

    def find(tokens: list[int]) -> Residence:
        return pool.find_bytes(key(1), token_bytes(tokens), token_bytes([1]))

    pool = ChunkBlockPool(num_blocks=2, block_size=2)
    pool.allocate(key(1), 2)
    assert find([5, 6]) == Residence.ABSENT  # writer not done
    assert pool.publish(key(1), [5, 6], [1])  # the writer's pin drops
    assert pool.lru_order() == [key(1)]
    assert find([5, 6]) == Residence.RESIDENT
    assert find([5, 7]) == Residence.COLLISION
    pool.allocate(key(2), 4)  # evicts key(1)
    assert find([5, 6]) == Residence.ABSENT
    assert pool.num_published == 0
    assert pool.publish(key(2), [1, 2, 3, 4], [], keep_pin=True)
    assert pool.get(key(2)).pin_count == 1
    pool.retire_all()
    assert pool.num_published == 0 and not pool.is_published(key(2))
    pool.unpin(key(2))
    assert pool.usage().blocks_used == 0


def test_publish_hands_the_writers_pin_over_or_drops_it_never_filing_a_retired_entry():
    pool = ChunkBlockPool(num_blocks=4, block_size=2)
    pool.allocate(key(1), 2)  # [0]
    pool.allocate(key(2), 2)  # [1]
    assert pool.publish(key(1), [5, 6], [], keep_pin=True)  # the put's pin now
    assert pool.get(key(1)).pin_count == 1 and pool.lru_order() == []
    pool.retire_all()
    # Retired while its writer ran: not filed, and the writer's pin drops even
    # when asked to keep it, freeing the entry (its rows are from old weights).
    assert not pool.publish(key(2), [7, 8], [], keep_pin=True)
    assert key(2) not in pool and not pool.is_published(key(2))
    assert list(pool._free_blocks) == [2, 3, 1]


def test_unpin_all_drops_pins_in_order_then_frees_an_unfinished_entry():
    pool = ChunkBlockPool(num_blocks=4, block_size=2)
    for k in (1, 2, 3):
        pool.allocate(key(k), 2)  # [0], [1], [2], each pinned by its writer
    pool.pin(key(3))
    pool.unpin_all([key(2), key(1), key(3), key(3)], free=key(3))
    # key(3) was never published: freed; the others enter the LRU in the order
    # their last pin dropped.
    assert key(3) not in pool and pool.lru_order() == [key(2), key(1)]
    assert list(pool._free_blocks) == [3, 2]
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin_all([key(1)])


class PoolMachine(RuleBasedStateMachine):
    """Random alloc / pin / unpin / touch / evict / free / relocate /
    release_held against a model.

    The model is the obvious list-based LRU; the pool must agree with it on
    every eviction victim, and its block bookkeeping must never leak or
    double-own a block.
    """

    def __init__(self):
        super().__init__()
        self.pool = ChunkBlockPool(num_blocks=12, block_size=3)
        self.pins: dict[ChunkHash, int] = {}
        self.sizes: dict[ChunkHash, int] = {}
        self.lru: list[ChunkHash] = []  # unpinned, oldest first
        self.held: dict[str, int] = {}  # holder -> blocks held
        self.next_key = 0

    def _evictable_blocks(self) -> int:
        return sum(self.pool.blocks_needed(self.sizes[k]) for k in self.lru)

    @rule(num_tokens=st.integers(1, 14))
    def allocate(self, num_tokens):
        k = key(self.next_key)
        self.next_key += 1
        blocks = self.pool.blocks_needed(num_tokens)
        used = sum(self.pool.blocks_needed(n) for n in self.sizes.values())
        used += sum(self.held.values())
        fits = blocks <= 12 - used + self._evictable_blocks()
        assert self.pool.can_allocate(blocks) == fits
        if not fits:
            with pytest.raises(ValueError):
                self.pool.allocate(k, num_tokens)
            return
        expected_victims = []
        free = 12 - used
        while free < blocks:
            victim = self.lru.pop(0)
            expected_victims.append(victim)
            free += self.pool.blocks_needed(self.sizes.pop(victim))
            del self.pins[victim]
        alloc = self.pool.allocate(k, num_tokens)
        assert list(alloc.evicted) == expected_victims
        assert len(alloc.entry.block_ids) == blocks
        self.pins[k] = 1
        self.sizes[k] = num_tokens

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def pin(self, data):
        k = data.draw(st.sampled_from(sorted(self.pins)))
        self.pool.pin(k)
        if self.pins[k] == 0:
            self.lru.remove(k)
        self.pins[k] += 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        k = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        self.pool.unpin(k)
        self.pins[k] -= 1
        if self.pins[k] == 0:
            self.lru.append(k)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def touch(self, data):
        k = data.draw(st.sampled_from(sorted(self.pins)))
        self.pool.touch(k)
        if k in self.lru:
            self.lru.remove(k)
            self.lru.append(k)

    @rule()
    def evict(self):
        victim = self.pool.evict_lru()
        if not self.lru:
            assert victim is None
            return
        assert victim == self.lru.pop(0)
        del self.pins[victim], self.sizes[victim]

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def free(self, data):
        k = data.draw(st.sampled_from(sorted(self.pins)))
        if self.pins[k]:
            with pytest.raises(ValueError):
                self.pool.free(k)
            return
        self.pool.free(k)
        self.lru.remove(k)
        del self.pins[k], self.sizes[k]
        with pytest.raises(KeyError):
            self.pool.free(k)

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def relocate(self, data):
        k = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        holder = f"h{self.next_key}"
        self.next_key += 1
        blocks = self.pool.blocks_needed(self.sizes[k])
        used = sum(self.pool.blocks_needed(n) for n in self.sizes.values())
        free = 12 - used - sum(self.held.values())
        if blocks > free + self._evictable_blocks():
            assert self.pool.relocate(k, holder) is None
            return
        self.held[holder] = blocks
        moved = self.pool.relocate(k, holder)
        assert len(moved.held) == blocks
        expected_victims = []
        while free < blocks:
            victim = self.lru.pop(0)
            expected_victims.append(victim)
            free += self.pool.blocks_needed(self.sizes.pop(victim))
            del self.pins[victim]
        assert list(moved.evicted) == expected_victims
        assert not set(moved.held) & set(moved.entry.block_ids)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_held(self, data):
        holder = data.draw(st.sampled_from(sorted(self.held)))
        assert len(self.pool.release_held(holder)) == self.held.pop(holder)

    @invariant()
    def bookkeeping(self):
        owned = []
        for k in self.pins:
            entry = self.pool.get(k)
            assert entry is not None  # pinned entries are never evicted
            assert entry.pin_count == self.pins[k]
            assert len(entry.block_ids) == self.pool.blocks_needed(self.sizes[k])
            owned += entry.block_ids
        held = [b for h in self.held for b in self.pool.held_by(h)]
        assert len(held) == sum(self.held.values())
        free = list(self.pool._free_blocks)
        assert len(owned) == len(set(owned))  # no block owned twice
        assert not set(owned) & set(free)  # nor both owned and free
        # Every block is owned, held or free, exactly once: no leak.
        assert sorted(owned + held + free) == list(range(12))
        assert self.pool.lru_order() == self.lru  # exact LRU order
        usage = self.pool.usage()
        assert usage.blocks_used == len(owned) + len(held)
        assert usage.blocks_held == len(held)
        assert usage.num_entries == len(self.pins)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
