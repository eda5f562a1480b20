"""StoreTransfers, a worker's store path, without an engine (issue 39).

- A read the step gave up on keeps its host span until the store call returns
  (finding 1): a store double that answers TIMEOUT and writes into the span
  later, as a stuck Mooncake get does; the real store's side of that contract
  is in test_mooncake_store.py.
- An entry of --max-chunk-tokens tokens for Llama-3-8B shapes (32 layers,
  8 KV heads of 128, bf16: 128 KiB per token) is written to a real Mooncake
  Store and read back into other pool rows byte for byte (finding 3).
- The authenticated mode (finding 8): an entry sealed with the fleet's secret
  reads back; with another secret, or none, it is a miss.
- The weights fingerprint runs off the step (finding 5).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
    POOL_BLOCK_SIZE,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import entry_format
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.base import (
    ChunkStore,
    HostBuffer,
    Presence,
    StoreCode,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.connection import (
    SharedStore,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    EntryFetch,
    EntryPut,
    EntryRef,
    FetchOutcome,
    StoreReport,
    StoreStep,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.rank import (
    StoreRank,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.transfers import (
    StoreTransfers,
)

from tests.store_fleet import MooncakeFleet


def rank(max_chunk_tokens: int = 64) -> StoreRank:
    return StoreRank(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        model="m",
        rope="r",
        compute="c",
        max_chunk_tokens=max_chunk_tokens,
    )


def small_pool(blocks: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.{kv}": torch.randn(blocks * POOL_BLOCK_SIZE, 2, 8, generator=g)
        for i in range(2)
        for kv in "kv"
    }


def transfers(
    spec_text: str,
    tensors,
    *,
    store: ChunkStore | None = None,
    max_chunk_tokens: int = 64,
    fingerprint=lambda model: "w",
) -> StoreTransfers:
    # NOTE: a SharedStore of its own per test (not SharedStore.of): arenas and
    # connection are per test.
    shared = SharedStore(spec_text)
    if store is not None:
        shared.use(store)
    return StoreTransfers(
        rank(max_chunk_tokens),
        shared,
        nn.Linear(1, 1),
        tensors,
        "f32",
        fingerprint=fingerprint,
    )


def wait_identity(t: StoreTransfers) -> None:
    deadline = time.monotonic() + 10
    while t.identity is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def entry(tokens: list[int], start: int = 1) -> EntryRef:
    return EntryRef(
        content_hash=hash(tuple(tokens)) & ((1 << 128) - 1),
        token_ids=tuple(tokens),
        virtual_start=start,
        cache_salt=None,
        lora="",
    )


def rows_of(tensors, blocks, n):
    idx = torch.tensor(
        [b * POOL_BLOCK_SIZE + r for b in blocks for r in range(POOL_BLOCK_SIZE)]
    )[:n]
    return {name: t.index_select(0, idx).clone() for name, t in tensors.items()}


def step_until(
    t: StoreTransfers, fetch_id: str, timeout_s: float = 30.0
) -> FetchOutcome:
    deadline = time.monotonic() + timeout_s
    while True:
        t.on_step(StoreStep(epoch=0))
        report = t.take_report()
        if report is not None and fetch_id in report.outcomes:
            # A read given up on says in the same report whether it holds rows.
            lent = report.rows_lent.get(fetch_id, 0)
            returned = report.rows_returned.get(fetch_id, 0)
            assert lent == (1 if fetch_id in t._rows_held else returned), report
            return report.outcomes[fetch_id][0]
        assert time.monotonic() < deadline, f"no outcome for {fetch_id}"
        time.sleep(0.01)


def drain_puts(t: StoreTransfers, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while t._puts:
        t.on_step(StoreStep(epoch=0))
        assert time.monotonic() < deadline, "puts did not finish"
        time.sleep(0.01)


# -- finding 1: a span is the call's until the call returned ----------------------


class LateStore(ChunkStore):
    """A store whose first get does what a stuck Mooncake get does: the
    caller is told TIMEOUT, and the transfer lands later (`land_late`),
    after which the call returns (on_release). Other calls work at once,
    in memory."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.late: list[tuple[list[HostBuffer], object]] = []
        self.stuck_first_get = True

    def register_buffer(self, buffer):
        pass

    def batch_exists(self, keys):
        return [Presence.PRESENT if k in self.values else Presence.ABSENT for k in keys]

    def batch_get_into(self, keys, buffers, on_release=lambda: None):
        if self.stuck_first_get:
            self.stuck_first_get = False
            self.late.append((list(buffers), on_release))
            return [StoreCode.TIMEOUT] * len(keys)
        out = []
        for k, b in zip(keys, buffers):
            v = self.values.get(k)
            if v is None:
                out.append(StoreCode.ABSENT)
                continue
            _write(b, v)
            out.append(len(v))
        on_release()
        return out

    def batch_put_from(self, keys, buffers, on_release=lambda: None):
        for k, b in zip(keys, buffers):
            self.values.setdefault(k, _read(b))
        on_release()
        return [0] * len(keys)

    def close(self):
        pass

    def land_late(self, fill: int) -> None:
        """The stuck get's transfer lands (garbage), then the call returns."""
        for buffers, on_release in self.late:
            for b in buffers:
                _write(b, bytes([fill]) * b.nbytes)
            on_release()
        self.late = []


def _write(buf: HostBuffer, value: bytes) -> None:
    import ctypes

    ctypes.memmove(buf.ptr, value, min(len(value), buf.nbytes))


def _read(buf: HostBuffer) -> bytes:
    import ctypes

    return ctypes.string_at(buf.ptr, buf.nbytes)


def test_a_read_given_up_keeps_its_span_until_the_call_returns():
    store = LateStore()
    src = small_pool(seed=1)
    writer = transfers(
        "mooncake://127.0.0.1:1?read_timeout=0.05&arena=1MB&local_client=none",
        src,
        store=store,
    )
    wait_identity(writer)
    a, b = entry([1] + list(range(10, 40))), entry([1] + list(range(50, 90)))
    writer.on_step(
        StoreStep(epoch=0, puts=[EntryPut(a, (0, 1)), EntryPut(b, (2, 3, 4))])
    )
    drain_puts(writer)
    assert len(store.values) == 2

    dst = small_pool(seed=2)
    reader = transfers(
        "mooncake://127.0.0.1:1?read_timeout=0.05&arena=1MB&local_client=none",
        dst,
        store=store,
    )
    wait_identity(reader)
    # The first read is stuck: the step gives up on it (the document is computed).
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f1", a, (5, 6))]))
    assert step_until(reader, "f1") is FetchOutcome.TIMEOUT
    lent = reader.lent_bytes()
    assert lent > 0  # the span is still the store's
    # A second read takes other memory, and the stuck one landing late does
    # not touch what it read.
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f2", b, (1, 2, 3))]))
    store.land_late(fill=0x7F)
    assert step_until(reader, "f2") is FetchOutcome.OK
    got, want = rows_of(dst, (1, 2, 3), 40), rows_of(src, (2, 3, 4), 40)
    for name in got:
        assert torch.equal(got[name], want[name]), name
    reader.on_step(StoreStep(epoch=0))
    assert reader.lent_bytes() == 0 and reader.get_arena.in_use() == 0


class LateScatterStore(LateStore):
    """LateStore that scatters a value over buffers (as Mooncake's
    batch_get_into_multi_buffers does): a worker reads into pool rows."""

    scatters = True

    def batch_get_into_parts(self, keys, parts, on_release=lambda: None):
        if self.stuck_first_get:
            self.stuck_first_get = False
            self.late.append(([b for buffers in parts for b in buffers], on_release))
            return [StoreCode.TIMEOUT] * len(keys)
        out = []
        for k, buffers in zip(keys, parts):
            v = self.values.get(k)
            if v is None or len(v) != sum(b.nbytes for b in buffers):
                out.append(StoreCode.ABSENT if v is None else StoreCode.TOO_LARGE)
                continue
            off = 0
            for b in buffers:
                _write(b, v[off : off + b.nbytes])
                off += b.nbytes
            out.append(len(v))
        on_release()
        return out


def _reports(t: StoreTransfers, steps: int = 1) -> StoreReport:
    merged = StoreReport()
    for _ in range(steps):
        t.on_step(StoreStep(epoch=0))
        report = t.take_report()
        if report is not None:
            merged.aggregate(report)
    return merged


def test_a_read_into_pool_rows_given_up_holds_them_until_the_call_returns():
    """Finding 9 with finding 1's rule: a read lands in the pool rows the
    scheduler allocated, with only the header and the tag in host memory of
    its own; one the step gave up on reports its rows lent (the scheduler
    gives them to no one), and returned once the store's call has."""
    store = LateScatterStore()
    src = small_pool(seed=1)
    writer = transfers(
        "mooncake://127.0.0.1:1?read_timeout=0.05&arena=1MB&local_client=none",
        src,
        store=store,
    )
    wait_identity(writer)
    a, b = entry([1] + list(range(10, 40))), entry([1] + list(range(50, 90)))
    writer.on_step(
        StoreStep(epoch=0, puts=[EntryPut(a, (0, 1)), EntryPut(b, (2, 3, 4))])
    )
    drain_puts(writer)

    dst = small_pool(seed=2)
    reader = transfers(
        "mooncake://127.0.0.1:1?read_timeout=0.05&arena=1MB&local_client=none"
        "&direct_reads=1",
        dst,
        store=store,
    )
    wait_identity(reader)
    assert reader.reads_into_pool()
    spans = []
    allocate = reader.get_arena.allocate
    reader.get_arena.allocate = lambda n, **kw: spans.append(n) or allocate(n, **kw)
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f1", a, (5, 6))]))
    assert step_until(reader, "f1") is FetchOutcome.TIMEOUT
    # step_until took the report that said so; the rows stay lent meanwhile.
    assert reader._rows_held.keys() == {"f1"}
    assert _reports(reader, 3).rows_returned == {}

    # Blocks 1-3 are another fetch's (the scheduler gave 5-6 to no one): the
    # value lands there, split at the run 1-3 of each tensor.
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f2", b, (1, 2, 3))]))
    assert step_until(reader, "f2") is FetchOutcome.OK
    assert reader.counters["store_gets_into_pool"] == 1
    assert spans == [
        entry_format.header_nbytes(31) + 16,
        entry_format.header_nbytes(41) + 16,
    ]
    got, want = rows_of(dst, (1, 2, 3), 40), rows_of(src, (2, 3, 4), 40)
    for name in got:
        assert torch.equal(got[name], want[name]), name

    store.land_late(fill=0x7F)  # into rows 5-6 (lent) and f1's header span
    report = _reports(reader)
    assert report.rows_returned == {"f1": 1} and reader._rows_held == {}
    late = rows_of(dst, (5, 6), 30)
    assert all((v.view(torch.uint8) == 0x7F).all() for v in late.values())
    for name, rows in rows_of(dst, (1, 2, 3), 40).items():
        assert torch.equal(rows, want[name]), (
            name
        )  # the late write touched only its own
    assert reader.get_arena.in_use() == 0 and reader.lent_bytes() == 0


def test_a_read_given_up_after_its_call_returned_lends_nothing():
    """A read whose call returned (even late, even failed) holds no rows: the
    scheduler may compute the entry into them at once."""
    store = LateScatterStore()
    store.stuck_first_get = False
    reader = transfers(
        "mooncake://127.0.0.1:1?local_client=none", small_pool(), store=store
    )
    wait_identity(reader)
    reader.on_step(
        StoreStep(epoch=0, fetches=[EntryFetch("gone", entry([1, 2, 3]), (0,))])
    )
    assert step_until(reader, "gone") is FetchOutcome.ABSENT
    assert _reports(reader, 2).rows_lent == {} and reader._rows_held == {}


def test_a_put_span_is_not_reused_while_its_call_runs():
    """Puts too: the store reads a put's span until the call returns."""
    release = []

    class SlowPutStore(LateStore):
        def batch_put_from(self, keys, buffers, on_release=lambda: None):
            for k, b in zip(keys, buffers):
                self.values.setdefault(k, _read(b))
            release.append(on_release)
            return [StoreCode.TIMEOUT] * len(keys)

    store = SlowPutStore()
    t = transfers(
        "mooncake://127.0.0.1:1?arena=1MB&local_client=none", small_pool(), store=store
    )
    wait_identity(t)
    t.on_step(StoreStep(epoch=0, puts=[EntryPut(entry([1, 2, 3]), (0,))]))
    drain_puts(t)
    assert t.put_arena.in_use() > 0 and t.lent_bytes() > 0
    release.pop()()
    t.on_step(StoreStep(epoch=0))
    assert t.put_arena.in_use() == 0


# -- finding 5: the fingerprint is off the step -----------------------------------


def test_the_weights_fingerprint_never_runs_on_the_step():
    go = threading.Event()

    def slow_fingerprint(model):
        go.wait(30)
        return "w"

    store = LateStore()
    t = transfers(
        "mooncake://127.0.0.1:1?arena=1MB&local_client=none",
        small_pool(),
        store=store,
        fingerprint=slow_fingerprint,
    )
    t0 = time.monotonic()
    t.on_step(StoreStep(epoch=0, puts=[EntryPut(entry([1, 2, 3]), (0,))]))
    t.on_step(StoreStep(epoch=1))
    assert time.monotonic() - t0 < 5
    assert t.take_report() is None  # no identity before the fingerprint is done
    go.set()
    wait_identity(t)
    report = t.take_report()
    assert [i.epoch for i in report.identities] == [1]


# -- finding 10: weights loaded without a reset ----------------------------------


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def load_weights(self, weights):
        for name, t in weights:
            getattr(self, name).data.copy_(t)
        return {name for name, _ in weights}


def test_weights_loaded_without_a_reset_stop_puts_and_reads_until_the_next_epoch():
    """Before: a weight sync (load_weights) without a reset kept the old
    fingerprint in the keys, so entries computed with the new weights went to
    the store under the old version, for every replica of the old weights."""
    store = LateStore()
    store.stuck_first_get = False
    model = Model()
    shared = SharedStore("mooncake://127.0.0.1:1?arena=1MB&local_client=none")
    shared.use(store)
    t = StoreTransfers(
        rank(),
        shared,
        model,
        small_pool(),
        "f32",
        fingerprint=lambda m: str(float(m.w.sum())),
    )
    wait_identity(t)
    a, b = entry([1, 2, 3]), entry([1, 4, 5])
    t.on_step(StoreStep(epoch=0, puts=[EntryPut(a, (0,))]))
    drain_puts(t)
    assert len(store.values) == 1
    assert model.load_weights([("w", torch.ones(4))]) == {"w"}
    t.on_step(
        StoreStep(epoch=0, puts=[EntryPut(b, (1,))], fetches=[EntryFetch("f", a, (2,))])
    )
    drain_puts(t)
    assert len(store.values) == 1 and t.counters["store_puts_skipped"] == 1
    assert t.take_report().outcomes == {"f": [FetchOutcome.ERROR]}
    # The reset: a new epoch, fingerprinted again with the new weights.
    t.on_step(StoreStep(epoch=1))
    wait_identity(t)
    assert t.identity.weights_version == "4.0"
    t.on_step(StoreStep(epoch=1, puts=[EntryPut(b, (1,))]))
    drain_puts(t)
    assert len(store.values) == 2


# -- the real store ---------------------------------------------------------------


def _big_fleet(tmp_path, local_client: bool):
    # One 8B entry of 4096 tokens is 512 MiB; the client lends room for it.
    return MooncakeFleet(
        tmp_path, segment_bytes=1200 << 20, timeout_s=30.0, local_client=local_client
    )


@pytest.fixture(scope="module")
def big_fleet(tmp_path_factory):
    with _big_fleet(tmp_path_factory.mktemp("fleet"), local_client=False) as fleet:
        yield fleet


def test_an_entry_of_max_chunk_tokens_of_an_8b_model_round_trips(big_fleet):
    _round_trip_8b(big_fleet)


@pytest.mark.slow
def test_an_8b_entry_round_trips_through_the_nodes_client(tmp_path):
    """The same through the node's client (local_client; the read-bandwidth
    comparison of docs/design/chunk-store.md)."""
    with _big_fleet(tmp_path, local_client=True) as fleet:
        _round_trip_8b(fleet)


def _round_trip_8b(big_fleet) -> None:
    max_tokens = 4096  # ChunkCacheConfig.max_chunk_tokens' default
    blocks = -(-max_tokens // POOL_BLOCK_SIZE)
    g = torch.Generator().manual_seed(8)
    # Llama-3-8B per rank: 32 layers, K and V of 8 heads x 128, bf16.
    pool = {
        f"model.layers.{i}.self_attn.attn.{kv}": torch.randn(
            blocks * POOL_BLOCK_SIZE, 8, 128, generator=g
        ).to(torch.bfloat16)
        for i in range(32)
        for kv in "kv"
    }
    # NOTE: the read is given all the time it needs: this test is about size
    # (how long a read may take is test_a_read_given_up_keeps_its_span...).
    # direct_reads: in process the read lands in the pool's rows (finding 9).
    t = transfers(
        f"{big_fleet.spec_text}&read_timeout=120&direct_reads=1",
        pool,
        max_chunk_tokens=max_tokens,
    )
    assert t.row_bytes == 128 << 10
    assert t.shared_ready(60)
    wait_identity(t)
    tokens = [1] + [(7 * i) % 50000 + 2 for i in range(max_tokens)]
    e = entry(tokens)
    block_ids = tuple(range(blocks))
    want = {n: p[:max_tokens].clone() for n, p in pool.items()}
    t.on_step(StoreStep(epoch=0, puts=[EntryPut(e, block_ids)]))
    drain_puts(t, timeout_s=120)
    assert t.counters.get("store_puts") == 1, t.counters
    for p in pool.values():
        p.zero_()
    t.on_step(StoreStep(epoch=0, fetches=[EntryFetch("big", e, block_ids)]))
    assert step_until(t, "big", timeout_s=120) is FetchOutcome.OK
    for name, p in pool.items():
        assert torch.equal(p[:max_tokens], want[name]), name
    nbytes = t.counters["store_get_bytes"]
    src = torch.ones(int(nbytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):  # the first copy also faults the pages in
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    memcpy = nbytes / best
    read = nbytes / t.counters["store_get_seconds"]
    print(
        f"8B entry of {max_tokens} tokens "
        f"({big_fleet.spec().local_client or 'in process'}): "
        f"read at {read / 2**30:.2f} GiB/s, host memcpy {memcpy / 2**30:.2f} GiB/s "
        f"({100 * read / memcpy:.0f}%)"
    )
    assert (
        t.counters["store_get_bytes"]
        == entry_format.header_nbytes(len(tokens)) + max_tokens * (128 << 10) + 16
    )
    # In process (direct_reads) the read lands in the pool's rows (finding 9);
    # through the node's client only its shared memory can be written: the arena.
    assert t.counters.get("store_gets_into_pool", 0) == (
        0 if big_fleet.spec().local_client else 1
    )


def test_an_authenticated_entry_reads_back_only_with_the_fleets_secret(
    big_fleet, tmp_path
):
    secret, other = tmp_path / "fleet.key", tmp_path / "other.key"
    secret.write_bytes(b"s" * 32)
    other.write_bytes(b"o" * 32)
    base = big_fleet.spec_text
    src = small_pool(seed=3)
    writer = transfers(f"{base}&key_file={secret}", src)
    assert writer.shared_ready(60)
    wait_identity(writer)
    e = entry([1] + list(range(300, 340)))
    writer.on_step(StoreStep(epoch=0, puts=[EntryPut(e, (0, 1, 2))]))
    drain_puts(writer)
    assert writer.counters.get("store_puts") == 1
    outcomes = {}
    for name, spec in (
        ("secret", f"{base}&key_file={secret}"),
        ("other", f"{base}&key_file={other}"),
        ("none", base),
    ):
        dst = small_pool(seed=4)
        reader = transfers(f"{spec}&direct_reads=1", dst)
        assert reader.shared_ready(60)
        wait_identity(reader)
        reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch(name, e, (4, 5, 6))]))
        outcomes[name] = step_until(reader, name)
        assert reader.reads_into_pool()
        if name == "secret":
            got, want = rows_of(dst, (4, 5, 6), 40), rows_of(src, (0, 1, 2), 40)
            assert all(torch.equal(got[n], want[n]) for n in got)
        # NOTE: otherwise the rows hold the writer's bytes, unverified: the
        # read landed in them. A failed fetch's rows are never served (the
        # scheduler computes the entry into them before anyone reads it).
    assert outcomes == {
        "secret": FetchOutcome.OK,
        "other": FetchOutcome.VERIFY_FAILED,
        "none": FetchOutcome.VERIFY_FAILED,
    }


class RegistryStore(LateScatterStore):
    """Registers ranges as Mooncake does: one overlapping a registered range
    is refused (-600)."""

    def __init__(self):
        super().__init__()
        self.ranges: set[HostBuffer] = set()
        self.busy = False

    def register_buffer(self, b):
        if any(
            r.ptr < b.ptr + b.nbytes and b.ptr < r.ptr + r.nbytes for r in self.ranges
        ):
            raise RuntimeError("registering failed (ok, -600)")
        self.ranges.add(b)

    def unregister_buffer(self, b):
        self.ranges.remove(b)

    def idle(self):
        return not self.busy


@pytest.mark.parametrize("earlier_call_running", [False, True])
def test_a_later_engines_pool_in_an_earlier_ones_memory_is_registered_again(
    earlier_call_running,
):
    """A second engine of the process whose pool lies where the first one's
    was (freed with it): the stale registration goes, the new pool reads in
    place; unless a call of the store may still write there (then its reads
    go through the arena)."""
    store = RegistryStore()
    shared = SharedStore("mooncake://127.0.0.1:1?local_client=none&direct_reads=1")
    shared.use(store)
    memory = torch.zeros(2 * 4 * 8 * POOL_BLOCK_SIZE * 16 + 64)

    def pool(offset):
        n = 8 * POOL_BLOCK_SIZE * 16
        return {
            f"layers.0.{kv}": memory[offset + i * n : offset + (i + 1) * n].view(
                -1, 2, 8
            )
            for i, kv in enumerate("kv")
        }

    first = StoreTransfers(
        rank(), shared, nn.Linear(1, 1), pool(0), "f32", fingerprint=lambda m: "w"
    )
    arenas = set(store.ranges) - set(first._pool_buffers)  # the get and put arenas
    assert first.reads_into_pool() and store.ranges == arenas | set(first._pool_buffers)
    store.busy = earlier_call_running
    second = StoreTransfers(
        rank(), shared, nn.Linear(1, 1), pool(16), "f32", fingerprint=lambda m: "w"
    )
    assert second.reads_into_pool() is (not earlier_call_running)
    assert store.ranges == arenas | set(
        first._pool_buffers if earlier_call_running else second._pool_buffers
    )


# -- issue 50, finding 9: the MAC covers the header; the fingerprint backlog ------


def test_an_authenticated_entry_whose_header_tokens_were_rewritten_is_a_miss(tmp_path):
    """The tokens of an entry were bound to its key by xxh3-128 only (its
    content hash), and the MAC covered the key and the rows. A writer without
    the secret who finds other tokens of the same content hash (xxh3 is no
    cryptographic hash) rewrites the header's token ids, keeps the rows, the
    tag and the checksum (of the payload only), and a reader of those tokens
    is served the first tokens' KV. The MAC now covers the header."""
    secret = tmp_path / "fleet.key"
    secret.write_bytes(b"s" * 32)
    store = LateScatterStore()
    store.stuck_first_get = False
    spec = f"mooncake://127.0.0.1:1?arena=1MB&local_client=none&key_file={secret}"
    writer = transfers(spec, small_pool(seed=1), store=store)
    wait_identity(writer)
    tokens = [1] + list(range(10, 40))
    a = entry(tokens)
    writer.on_step(StoreStep(epoch=0, puts=[EntryPut(a, (0, 1))]))
    drain_puts(writer)
    ((key, value),) = store.values.items()

    # The forgery: other tokens of the same length under the same key (a
    # content-hash collision), everything else as written by the fleet.
    forged_tokens = [1] + list(range(110, 140))
    header = bytearray(value[: entry_format.header_nbytes(len(tokens))])
    off = entry_format.FIXED_NBYTES
    header[off : off + 4 * len(tokens)] = b"".join(
        t.to_bytes(4, "little") for t in forged_tokens
    )
    store.values[key] = bytes(header) + value[len(header) :]
    collision = EntryRef(
        content_hash=a.content_hash,
        token_ids=tuple(forged_tokens),
        virtual_start=a.virtual_start,
        cache_salt=None,
        lora="",
    )

    for direct in (True, False):
        reader = transfers(
            spec + ("&direct_reads=1" if direct else ""),
            small_pool(seed=2),
            store=store,
        )
        wait_identity(reader)
        assert reader.reads_into_pool() is direct
        # The genuine entry still reads back; the forged header does not.
        store.values[key] = value
        reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("genuine", a, (2, 3))]))
        assert step_until(reader, "genuine") is FetchOutcome.OK
        store.values[key] = bytes(header) + value[len(header) :]
        reader.on_step(
            StoreStep(epoch=0, fetches=[EntryFetch("forged", collision, (4, 5))])
        )
        assert step_until(reader, "forged") is FetchOutcome.VERIFY_FAILED, (
            f"a header rewritten without the secret was served (direct={direct})"
        )


def test_superseded_fingerprints_are_cancelled():
    """Each reset queued a full hash of the weights on the fingerprint thread,
    and none was ever dropped: resets faster than a hash grew the backlog
    without bound. A fingerprint no longer the current epoch's is cancelled
    unless it already runs; a put of a superseded epoch is skipped."""
    go = threading.Event()
    calls = []

    def slow_fingerprint(model):
        calls.append(time.monotonic())
        go.wait(30)
        return "w"

    store = LateStore()
    t = transfers(
        "mooncake://127.0.0.1:1?arena=1MB&local_client=none",
        small_pool(),
        store=store,
        fingerprint=slow_fingerprint,
    )
    deadline = time.monotonic() + 10
    while not calls:  # epoch 0's hash runs
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t.on_step(StoreStep(epoch=1, puts=[EntryPut(entry([1, 2, 3]), (0,))]))
    for epoch in range(2, 50):
        t.on_step(StoreStep(epoch=epoch))
    go.set()
    wait_identity(t)
    assert t.identity.epoch == 49
    deadline = time.monotonic() + 10
    while t._puts:  # NOTE: drain_puts steps at epoch 0, which is a reset
        t.on_step(StoreStep(epoch=49))
        assert time.monotonic() < deadline, "puts did not finish"
        time.sleep(0.01)
    time.sleep(0.2)  # anything still queued would run now
    # Epoch 0's (already running) and epoch 49's: nothing in between.
    assert len(calls) == 2, f"{len(calls)} fingerprints ran for 2 epochs that count"
    # Epoch 1's put had no identity to be keyed with: skipped, never stored.
    assert store.values == {} and t.counters.get("store_puts_skipped") == 1
    assert t.put_arena.in_use() == 0 and t.lent_bytes() == 0


# -- issue 50, finding 5: a call that runs past the deadline; reads queued behind it --


class BlockingScatterStore(LateScatterStore):
    """A store whose first get is a real stuck call: it blocks (on `go`) well
    past the read deadline, then writes garbage into every buffer it was
    given, then returns (TIMEOUT) and releases. The step thread sees a future
    still running at the deadline, as with a stopped holder or RDMA. Other
    gets work at once; `gets` counts the calls that reached the store."""

    def __init__(self):
        super().__init__()
        self.stuck_first_get = False
        self.block_first = True
        self.go = threading.Event()
        self.entered = threading.Event()
        self.gets = 0

    def batch_get_into_parts(self, keys, parts, on_release=lambda: None):
        self.gets += 1
        if self.block_first:
            self.block_first = False
            self.entered.set()
            assert self.go.wait(30)
            for buffers in parts:
                for b in buffers:
                    _write(b, bytes([0x7F]) * b.nbytes)
            on_release()
            return [StoreCode.TIMEOUT] * len(keys)
        return super().batch_get_into_parts(keys, parts, on_release)


def _blocking_reader(store: BlockingScatterStore):
    src = small_pool(seed=1)
    writer = transfers(
        "mooncake://127.0.0.1:1?arena=1MB&local_client=none", src, store=store
    )
    wait_identity(writer)
    a, b = entry([1] + list(range(10, 40))), entry([1] + list(range(50, 90)))
    writer.on_step(
        StoreStep(epoch=0, puts=[EntryPut(a, (0, 1)), EntryPut(b, (2, 3, 4))])
    )
    drain_puts(writer)
    dst = small_pool(seed=2)
    reader = transfers(
        "mooncake://127.0.0.1:1?read_timeout=0.05&timeout=0.05&arena=1MB"
        "&local_client=none&direct_reads=1",
        dst,
        store=store,
    )
    wait_identity(reader)
    assert reader.reads_into_pool()
    return reader, dst, a, b


def test_a_read_queued_behind_a_stuck_call_is_cancelled_and_lends_nothing():
    """f1's call is stuck past its deadline: its rows stay lent until the call
    returns, and its late write lands in them then. f2, queued behind it on the
    get thread, never reached the store: before, its deadline (counted from
    submit) passed too and its rows were reported lent although nothing held
    them; now its call is cancelled, nothing is lent, and it never runs."""
    store = BlockingScatterStore()
    reader, dst, a, b = _blocking_reader(store)
    untouched = rows_of(dst, (1, 2, 3), 40)
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f1", a, (5, 6))]))
    assert store.entered.wait(10)
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f2", b, (1, 2, 3))]))
    outcomes, lent = {}, {}
    deadline = time.monotonic() + 10
    while len(outcomes) < 2:
        reader.on_step(StoreStep(epoch=0))
        report = reader.take_report()
        if report is not None:
            outcomes.update({k: v[0] for k, v in report.outcomes.items()})
            lent.update(report.rows_lent)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert outcomes == {"f1": FetchOutcome.TIMEOUT, "f2": FetchOutcome.TIMEOUT}
    assert lent == {"f1": 1}, f"rows reported lent: {lent} (f2's call never started)"
    assert set(reader._rows_held) == {"f1"}
    # The stuck call is still the store's: rows 5-6 and f1's span stay lent.
    assert _reports(reader, 3).rows_returned == {}
    assert reader.lent_bytes() > 0

    store.go.set()  # the call writes late, then returns
    deadline = time.monotonic() + 10
    returned = {}
    while not returned:
        returned = _reports(reader).rows_returned
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert returned == {"f1": 1} and reader._rows_held == {}
    late = rows_of(dst, (5, 6), 30)
    assert all((v.view(torch.uint8) == 0x7F).all() for v in late.values())
    time.sleep(0.2)
    _reports(reader, 2)
    assert store.gets == 1, "the cancelled read reached the store"
    for name, rows in rows_of(dst, (1, 2, 3), 40).items():
        assert torch.equal(rows, untouched[name]), name
    assert reader.get_arena.in_use() == 0 and reader.lent_bytes() == 0
    # The connection serves on.
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f3", b, (1, 2, 3))]))
    assert step_until(reader, "f3") is FetchOutcome.OK


def test_a_read_whose_deadline_passed_in_the_queue_is_not_started():
    """The get thread reaches a read after its deadline, before the step gave
    it up: it does not call the store (the step computes the document anyway),
    and it lends nothing."""
    store = BlockingScatterStore()
    reader, dst, a, b = _blocking_reader(store)
    untouched = rows_of(dst, (1, 2, 3), 40)
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f1", a, (5, 6))]))
    assert store.entered.wait(10)
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f2", b, (1, 2, 3))]))
    time.sleep(0.3)  # f2's deadline passes in the queue; no step runs meanwhile
    store.go.set()
    f2 = reader._reads["f2"].future
    deadline = time.monotonic() + 10
    while not f2.done():  # the get thread took f2 (no step ran: none cancelled it)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not f2.cancelled()
    assert store.gets == 1, "a read past its deadline was started"
    merged = _reports(reader, 2)
    assert {k: v[0] for k, v in merged.outcomes.items()} == {
        "f1": FetchOutcome.TIMEOUT,
        "f2": FetchOutcome.TIMEOUT,
    }
    assert merged.rows_lent == {}
    for name, rows in rows_of(dst, (1, 2, 3), 40).items():
        assert torch.equal(rows, untouched[name]), name
    assert reader.get_arena.in_use() == 0 and reader.lent_bytes() == 0


def test_verification_makes_no_torch_view_on_the_get_thread():
    """NOTE: torch views made on the get thread once kept verification from
    finishing in the engine's process (transfers.py); the pool's bytes are
    numpy views made at start-up, and so must the arena's be."""
    store = LateScatterStore()
    store.stuck_first_get = False
    src = small_pool(seed=1)
    writer = transfers(
        "mooncake://127.0.0.1:1?arena=1MB&local_client=none", src, store=store
    )
    wait_identity(writer)
    a = entry([1] + list(range(10, 40)))
    writer.on_step(StoreStep(epoch=0, puts=[EntryPut(a, (0, 1))]))
    drain_puts(writer)
    for direct in (True, False):
        reader = transfers(
            "mooncake://127.0.0.1:1?arena=1MB&local_client=none"
            + ("&direct_reads=1" if direct else ""),
            small_pool(seed=2),
            store=store,
        )
        wait_identity(reader)
        assert reader.reads_into_pool() is direct
        threads: list[str] = []

        def recording_view(*args, view=reader.get_arena.view, threads=threads):
            threads.append(threading.current_thread().name)
            return view(*args)

        reader.get_arena.view = recording_view
        reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f", a, (2, 3))]))
        assert step_until(reader, "f") is FetchOutcome.OK
        assert not [n for n in threads if n.startswith("chunk-store-get")], threads


# -- issue 50, finding 1: a late read into the pool of a closed engine --------------


def _pool_reader_with_a_stuck_read(seed: int = 2):
    """A reader whose read into pool rows 5-6 was given up on while the store's
    call still holds them (LateScatterStore: TIMEOUT now, the write later)."""
    store = LateScatterStore()
    src = small_pool(seed=1)
    writer = transfers(
        "mooncake://127.0.0.1:1?read_timeout=0.05&arena=1MB&local_client=none",
        src,
        store=store,
    )
    wait_identity(writer)
    a = entry([1] + list(range(10, 40)))
    writer.on_step(StoreStep(epoch=0, puts=[EntryPut(a, (0, 1))]))
    drain_puts(writer)
    dst = small_pool(seed=seed)
    reader = transfers(
        "mooncake://127.0.0.1:1?read_timeout=0.05&arena=1MB&local_client=none"
        "&direct_reads=1",
        dst,
        store=store,
    )
    wait_identity(reader)
    assert reader.reads_into_pool()
    reader.on_step(StoreStep(epoch=0, fetches=[EntryFetch("f1", a, (5, 6))]))
    assert step_until(reader, "f1") is FetchOutcome.TIMEOUT
    assert reader._rows_held.keys() == {"f1"} and store.late
    return store, reader, dst


def test_a_closed_engines_pool_stays_allocated_until_a_late_read_into_it_returns():
    """Mooncake was handed raw pointers into the pool; nothing kept the pool
    alive until the call's release. An engine closed (`del llm`) while such a
    call hangs freed its pool, and the late write then landed in whatever the
    next engine (or anything) had put there, or in unmapped memory. The pool's
    memory now stays allocated until the call returns, and not longer."""
    import gc
    import weakref

    store, reader, dst = _pool_reader_with_a_stuck_read()
    pool = weakref.ref(dst["layers.0.k"])
    del reader, dst  # the engine goes (no close: `del llm` without a shutdown)
    gc.collect()
    assert pool() is not None, (
        "the pool was freed while a store call may still write into it"
    )
    # The call writes (into memory still the pool's), then returns: its
    # on_release is the last hold on the pool.
    store.land_late(fill=0x7F)
    gc.collect()
    assert pool() is None, "the pool outlived the store's call"


def test_closing_waits_for_the_calls_in_flight_and_frees_their_memory():
    """A call that returns within the close's wait: the close returns once it
    has, nothing is held, and the shared arenas (a later engine of the process
    gets them) have every span back."""
    store, reader, dst = _pool_reader_with_a_stuck_read()
    timer = threading.Timer(0.3, store.land_late, kwargs={"fill": 0x7F})
    timer.start()
    t0 = time.monotonic()
    assert reader.close(timeout_s=10) == 0
    assert 0.2 < time.monotonic() - t0 < 5
    timer.join()
    assert reader.get_arena.in_use() == 0 and reader.put_arena.in_use() == 0
    assert reader.lent_bytes() == 0
    # A closed engine starts no calls.
    reader.on_step(
        StoreStep(epoch=0, fetches=[EntryFetch("late", entry([1, 2, 3]), (0,))])
    )
    assert store.late == [] and reader._reads == {}


def test_closing_under_a_call_that_does_not_return_accounts_for_it():
    """A call still running when the close's wait ends: the close says so
    (one call holds this engine's memory), and that memory stays allocated."""
    import gc
    import weakref

    store, reader, dst = _pool_reader_with_a_stuck_read()
    pool = weakref.ref(dst["layers.0.k"])
    t0 = time.monotonic()
    assert reader.close(timeout_s=0.2) == 1
    assert time.monotonic() - t0 < 5
    del reader, dst
    gc.collect()
    assert pool() is not None
    store.land_late(fill=0x7F)
    gc.collect()
    assert pool() is None


def test_the_connectors_shutdown_closes_the_store_path():
    """VLLM's worker shutdown calls the connector's `shutdown`: the store's
    calls in flight are waited for (a store deadline) and accounted for."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.connector import (
        ChunkCacheConnector,
    )

    store, reader, dst = _pool_reader_with_a_stuck_read()
    reader.spec = SimpleNamespace(timeout_s=0.1)  # the wait: a store deadline
    connector = ChunkCacheConnector.__new__(ChunkCacheConnector)
    connector._scheduler, connector._worker = None, SimpleNamespace(store=reader)
    connector.shutdown()
    assert reader.counters.get("store_calls_held_at_close") == 1
    reader.on_step(
        StoreStep(epoch=0, fetches=[EntryFetch("late", entry([1, 2, 3]), (0,))])
    )
    assert reader._reads == {}
    store.land_late(fill=0)
