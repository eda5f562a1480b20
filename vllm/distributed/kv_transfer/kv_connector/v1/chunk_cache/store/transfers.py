# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A worker's side of the fleet-wide chunk store (docs/design/store-path.md).

Per step (`on_step`, before any load): a new epoch's weights are fingerprinted
off the step; finished children's rows are copied into the put arena, then
keyed, sealed and written on the put thread; fetches read and verified on the
get thread are copied into their pool rows and reported (every rank must
verify its own key); new fetches are read into the get arena (with
`direct_reads`, straight into the pool rows). Memory lent to a store call is
freed only when the call has returned, never at a deadline; pool rows held so
are reported lent (`StoreReport.rows_lent`) until then.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from vllm.logger import init_logger

from ..setup import POOL_BLOCK_SIZE
from . import entry_format
from .base import HostBuffer, StoreCode
from .connection import SharedStore
from .integrity import TAG_BYTES, EntrySeal
from .lora_loads import LOADED_SEP, LoadedLoras
from .messages import (
    EntryFetch,
    EntryPut,
    EntryRef,
    FetchOutcome,
    RankIdentity,
    StoreReport,
    StoreStep,
    store_key_for,
)
from .rank import StoreRank
from .weights import weights_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# The least host memory per kind of call (reads, writes).
MIN_ARENA_BYTES = 256 << 20
# A read is given this many times its expected transfer time (at the
# bandwidth measured) before the document is computed instead.
READ_SLACK = 4.0
# The bandwidth assumed before any read was measured.
INITIAL_READ_BYTES_PER_S = 1 << 30
# What _put returns for an entry it did not store (its epoch's fingerprint
# was cancelled by a later reset: it has no key).
_SKIPPED = None
_MISS_OF_CODE: dict[int, FetchOutcome] = {
    StoreCode.ABSENT: FetchOutcome.ABSENT,
    StoreCode.TIMEOUT: FetchOutcome.TIMEOUT,
}


def entry_nbytes(num_tokens: int, num_rows: int, row_bytes: int) -> int:
    """Header + rows + tag of an entry of `num_tokens` header tokens."""
    return entry_format.header_nbytes(num_tokens) + num_rows * row_bytes + TAG_BYTES


def default_arena_bytes(max_chunk_tokens: int, row_bytes: int) -> int:
    """Two of the largest entries (a segment of --max-chunk-tokens after a
    context as long), at least MIN_ARENA_BYTES, per kind of call."""
    largest = entry_nbytes(2 * max_chunk_tokens, max_chunk_tokens, row_bytes)
    return max(MIN_ARENA_BYTES, 2 * largest + 2 * 64)


def copy_fence(device: torch.device) -> torch.cuda.Event | None:
    """An event after the copies just issued on `device` (None where copies
    are synchronous): the pool <-> arena copies are non-blocking on a GPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


@dataclass
class _Span:
    """A span of an arena lent to a store call: freed once the call returned
    (`released`) and any copy from it is done (`fence`)."""

    start: int
    nbytes: int
    released: threading.Event = field(default_factory=threading.Event)
    fence: torch.cuda.Event | None = None

    def free_now(self) -> bool:
        return self.released.is_set() and (self.fence is None or self.fence.query())


class _CallLease:
    """What one store call was given that must outlive it: the event its spans
    wait on and the memory it writes into (the arena; for a read into pool
    rows, the pool tensors, which a closed engine would otherwise free under
    it). It is the call's `on_release`: whatever holds the call holds them."""

    __slots__ = ("released", "_keep")

    def __init__(self, released: threading.Event, keep: list[object] | None):
        self.released = released
        self._keep = keep

    def release(self) -> None:
        self._keep = None
        self.released.set()


@dataclass(frozen=True)
class _PoolPart:
    """Rows [first_row, first_row + num_rows) of pool tensor `tensor`."""

    tensor: int
    first_row: int
    num_rows: int


@dataclass
class _Read:
    fetch: EntryFetch
    span: _Span
    head: int
    # Where the payload lands: pool rows (the span holds the header and the
    # tag only), or None (the span holds all of it).
    parts: list[_PoolPart] | None
    lease: _CallLease
    # Its place in its step's call.
    index: int


@dataclass
class _Pending:
    read: _Read
    future: Future[list[FetchOutcome]]
    deadline: float


@dataclass
class _Put:
    future: Future[int | None]
    span: _Span


class StoreTransfers:
    def __init__(
        self,
        rank: StoreRank,
        shared: SharedStore,
        model: nn.Module,
        tensors: dict[str, torch.Tensor],
        kv_dtype: str,
        fingerprint: Callable[[nn.Module], str] = weights_fingerprint,
    ):
        self.rank = rank
        self._shared = shared
        self.spec = shared.spec
        self.seal = EntrySeal.from_key_file(self.spec.key_file)
        self.model = model
        self.kv_dtype = kv_dtype
        self._fingerprint_fn = fingerprint
        # The payload: each tensor's rows, tensor after tensor in name order,
        # then the seal's tag.
        self.names = sorted(tensors)
        self.tensors = [tensors[n] for n in self.names]
        self.row_bytes_of = [t[0].numel() * t.element_size() for t in self.tensors]
        self.row_bytes = sum(self.row_bytes_of)
        self.kv_layout = ";".join(
            f"{n}:{tuple(t.shape[1:])}:{t.dtype}"
            for n, t in zip(self.names, self.tensors)
        )
        self.max_entry_bytes = entry_nbytes(
            2 * rank.max_chunk_tokens, rank.max_chunk_tokens, self.row_bytes
        )
        arena_bytes = self.spec.arena_bytes or default_arena_bytes(
            rank.max_chunk_tokens, self.row_bytes
        )
        if arena_bytes < self.max_entry_bytes + 64:
            raise ValueError(
                f"--chunk-store arena={arena_bytes} bytes cannot hold one entry "
                f"of --max-chunk-tokens {rank.max_chunk_tokens} tokens "
                f"({self.max_entry_bytes} bytes for this model on this rank): "
                "give at least that, or leave arena out to size it from the model"
            )
        # Reads and writes have arenas of their own: writes never starve reads.
        shared.want_arenas(arena_bytes)
        # With direct_reads, a host pool the connection reaches takes reads.
        # Its bytes as numpy, made here: the get thread verifies rows through
        # numpy only (with torch views made there, verification did not finish
        # in the engine's process; cause not found).
        self._pool_buffers: list[HostBuffer] = []
        self._pool_bytes = []
        if self.spec.direct_reads and all(
            t.device.type == "cpu" and t.is_contiguous() for t in self.tensors
        ):
            self._pool_buffers = [
                HostBuffer(t.data_ptr(), t.nbytes) for t in self.tensors
            ]
            shared.want_pool(self._pool_buffers)
            self._pool_bytes = [
                t.reshape(-1).view(torch.uint8).numpy() for t in self.tensors
            ]
        self._get_thread = ThreadPoolExecutor(1, thread_name_prefix="chunk-store-get")
        self._put_thread = ThreadPoolExecutor(1, thread_name_prefix="chunk-store-put")
        self._fp_thread = ThreadPoolExecutor(
            1, thread_name_prefix="chunk-store-weights"
        )
        self.epoch = -1
        # The identity of `epoch`: made on the fingerprint thread.
        self._identity: Future[RankIdentity] | None = None
        self._identity_reported = False
        self._reads: dict[str, _Pending] = {}
        # Fetches whose pool rows a given-up read's call still holds, and
        # what this step reports lent / returned.
        self._rows_held: dict[str, _Span] = {}
        self._rows_lent: dict[str, int] = {}
        self._rows_returned: dict[str, int] = {}
        # Spans whose step is done but whose call has not returned yet.
        self._lent: list[tuple[object, _Span]] = []
        self._outcomes: dict[str, FetchOutcome] = {}
        self._puts: list[_Put] = []
        self._read_bytes_per_s = float(INITIAL_READ_BYTES_PER_S)
        # A new measurement since the last report (for ReadCost).
        self._bandwidth_news = False
        self.counters: dict[str, float] = {}
        self._reported: dict[str, float] = {}
        self._counter_lock = threading.Lock()
        # Set when the model's load_weights runs, cleared at the next epoch.
        self.weights_changed = False
        self._closed = False
        self._watch_weight_loads(model)
        self.loras = LoadedLoras()
        self.loras.watch(model)
        shared.start_connecting()
        self._new_epoch(0)

    def _watch_weight_loads(self, model: nn.Module) -> None:
        """Weight updates (reload_weights, RL weight syncs) load through
        `load_weights`. Until the reset that must follow, keys still carry the
        old weights' fingerprint, so reads and writes stop until the next
        epoch. Weights written by other means are not seen: reset after any
        change (vLLM's prefix cache asks the same)."""
        original = getattr(model, "load_weights", None)
        if not callable(original):
            return

        def load_weights(*args, **kwargs):
            self.weights_changed = True
            return original(*args, **kwargs)

        model.load_weights = load_weights

    @classmethod
    def for_engine(
        cls,
        vllm_config: VllmConfig,
        model: nn.Module,
        tensors: dict[str, torch.Tensor],
        kv_dtype: str,
    ) -> StoreTransfers:
        spec_text = vllm_config.chunk_cache_config.chunk_store
        assert spec_text is not None
        rank = StoreRank.from_engine(vllm_config, model)
        return cls(rank, SharedStore.of(spec_text), model, tensors, kv_dtype)

    @property
    def get_arena(self):
        return self._shared.arena("get")

    @property
    def put_arena(self):
        return self._shared.arena("put")

    @property
    def identity(self) -> RankIdentity | None:
        """This epoch's identity once fingerprinted (None before)."""
        f = self._identity
        if f is None or not f.done() or f.cancelled() or f.exception() is not None:
            return None
        return f.result()

    def on_step(self, step: StoreStep) -> None:
        if self._closed:
            return
        if step.epoch != self.epoch:
            self._new_epoch(step.epoch)
        for put in step.puts:
            self._start_put(put)
        self._finish_reads()
        self._start_reads(step.fetches)
        self._reap()

    def take_report(self) -> StoreReport | None:
        report = StoreReport(
            outcomes={k: [v] for k, v in self._outcomes.items()},
            rows_lent=self._rows_lent,
            rows_returned=self._rows_returned,
        )
        self._outcomes, self._rows_lent, self._rows_returned = {}, {}, {}
        report.lora_loads = {k: [v] for k, v in self.loras.take_loads().items()}
        if self._bandwidth_news:
            report.read_bytes_per_s = self._read_bytes_per_s
            self._bandwidth_news = False
        identity = self.identity
        if identity is not None and not self._identity_reported:
            report.identities.append(identity)
            self._identity_reported = True
        return None if report.is_empty() else report

    def take_counters(self) -> dict[str, float]:
        """Increments of the (cumulative) counters since the last call."""
        with self._counter_lock:
            now = dict(self.counters)
        last, self._reported = self._reported, now
        return {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}

    def _count(self, name: str, value: float = 1) -> None:
        with self._counter_lock:  # the store threads count too
            self.counters[name] = self.counters.get(name, 0) + value

    def _new_epoch(self, epoch: int) -> None:
        """Fingerprint the weights of `epoch` off the step."""
        self.epoch = epoch
        self.weights_changed = False
        self._identity_reported = False
        # A fingerprint not started yet is of no use once superseded: at most
        # one runs and one waits, however fast resets come.
        if self._identity is not None:
            self._identity.cancel()
        self._identity = self._fp_thread.submit(self._make_identity, epoch)

    def _make_identity(self, epoch: int) -> RankIdentity:
        t0 = time.monotonic()
        version = self._fingerprint_fn(self.model)
        logger.info(
            "chunk store: epoch %d, weights version %s (rank tp%d/pp%d, %.2f s, "
            "off the step)",
            epoch,
            version[:16],
            self.rank.tp_rank,
            self.rank.pp_rank,
            time.monotonic() - t0,
        )
        return RankIdentity(
            epoch=epoch,
            tp_rank=self.rank.tp_rank,
            pp_rank=self.rank.pp_rank,
            model=self.rank.model,
            weights_version=version,
            kv_dtype=self.kv_dtype,
            kv_layout=self.kv_layout,
            rope=self.rank.rope,
            compute=self.rank.compute,
            row_bytes=self.row_bytes,
        )

    def _key(self, identity: RankIdentity, entry: EntryRef) -> str:
        return store_key_for(identity, self.rank.tp_size, self.rank.pp_size, entry)

    def _rows(self, pool_block_ids: tuple[int, ...], num_rows: int) -> torch.Tensor:
        blocks = torch.tensor(pool_block_ids, dtype=torch.int64)
        rows = (
            blocks[:, None] * POOL_BLOCK_SIZE + torch.arange(POOL_BLOCK_SIZE)[None, :]
        ).reshape(-1)[:num_rows]
        return rows.to(self.tensors[0].device)

    def _pool_parts(
        self, pool_block_ids: tuple[int, ...], num_rows: int
    ) -> list[_PoolPart]:
        """The payload's pieces in the pool, in the value's order: per tensor
        (name order), one piece per run of consecutive blocks."""
        runs: list[list[int]] = []
        left = num_rows
        for block in pool_block_ids:
            n = min(POOL_BLOCK_SIZE, left)
            if n <= 0:
                break
            first = block * POOL_BLOCK_SIZE
            if runs and runs[-1][0] + runs[-1][1] == first:
                runs[-1][1] += n
            else:
                runs.append([first, n])
            left -= n
        return [
            _PoolPart(i, first, n)
            for i in range(len(self.tensors))
            for first, n in runs
        ]

    def _part_buffer(self, part: _PoolPart) -> HostBuffer:
        row = self.row_bytes_of[part.tensor]
        return HostBuffer(
            self._pool_buffers[part.tensor].ptr + part.first_row * row,
            part.num_rows * row,
        )

    def _part_bytes(self, part: _PoolPart):
        row = self.row_bytes_of[part.tensor]
        return self._pool_bytes[part.tensor][
            part.first_row * row : (part.first_row + part.num_rows) * row
        ]

    def _payload_views(self, arena, start: int, num_rows: int) -> list[torch.Tensor]:
        views, off = [], start
        for t in self.tensors:
            n = num_rows * t[0].numel() * t.element_size()
            views.append(arena.view(off, n).view(t.dtype).view(num_rows, *t.shape[1:]))
            off += n
        return views

    # --------------------------------------------------------------- puts

    def _start_put(self, put: EntryPut) -> None:
        entry = put.entry
        if self.weights_changed or (
            entry.lora and not self.loras.holds(entry.lora.rpartition(LOADED_SEP)[2])
        ):
            # The adapter the scheduler keyed the entry by is not what this
            # rank holds now (reloaded since): never written.
            self._count("store_puts_skipped")
            return
        num_rows = len(entry.token_ids) - entry.virtual_start
        head = entry_format.header_nbytes(len(entry.token_ids))
        nbytes = entry_nbytes(len(entry.token_ids), num_rows, self.row_bytes)
        arena = self.put_arena
        start = None if arena is None else arena.allocate(nbytes, tail_align_at=head)
        if start is None:
            self._count("store_puts_skipped")
            return
        rows = self._rows(put.pool_block_ids, num_rows)
        for t, dst in zip(
            self.tensors, self._payload_views(arena, start + head, num_rows)
        ):
            # Copied inside the step: the rows may be reused from the next one.
            dst.copy_(t.index_select(0, rows), non_blocking=True)
        span = _Span(start, nbytes, fence=copy_fence(self.tensors[0].device))
        identity = self._identity
        assert identity is not None
        self._puts.append(
            _Put(self._put_thread.submit(self._put, identity, entry, span, head), span)
        )

    def _put(
        self, identity: Future[RankIdentity], entry: EntryRef, span: _Span, head: int
    ) -> int | None:
        # The entry's key waits for its epoch's fingerprint (on this thread).
        try:
            key = self._key(identity.result(), entry)
        except CancelledError:
            # A reset came before this epoch's fingerprint ran: no key.
            span.released.set()
            return _SKIPPED
        if span.fence is not None:
            span.fence.synchronize()  # the rows' copy into the arena
        payload = span.nbytes - head
        body = self.put_arena.bytes_view(span.start + head, payload)
        # The tag covers the header but its checksum (zero here: it covers the
        # tag), as entry_format.header_for_mac gives it to a reader.
        fields = (int(entry.virtual_start), tuple(int(t) for t in entry.token_ids))
        mac_header = entry_format.encode_header(
            entry_format.EntryHeader(entry_format.FORMAT_VERSION, *fields, payload, 0)
        )
        body[payload - TAG_BYTES :] = memoryview(
            self.seal.tag_of_parts(key, mac_header, [body[: payload - TAG_BYTES]])
        )
        header = entry_format.encode_header(
            entry_format.make_header(entry.virtual_start, entry.token_ids, body)
        )
        self.put_arena.bytes_view(span.start, head)[:] = memoryview(header)
        store = self._shared.get()
        if store is None:
            span.released.set()
            return StoreCode.ERROR
        lease = _CallLease(span.released, [self.put_arena])
        return store.batch_put_from(
            [key],
            [HostBuffer(self.put_arena.ptr + span.start, span.nbytes)],
            on_release=lease.release,
        )[0]

    def _reap(self) -> None:
        still = []
        for put in self._puts:
            if not put.future.done():
                still.append(put)
                continue
            try:
                code = put.future.result()
            except Exception as e:
                logger.warning("chunk store: put failed: %s", e)
                put.span.released.set()  # raised before the store was given it
                code = StoreCode.ERROR
            if code is _SKIPPED:
                self._count("store_puts_skipped")
            elif code == 0:
                self._count("store_puts")
                self._count("store_put_bytes", put.span.nbytes)
            else:
                self._count("store_put_failures")
            self._finish_span(self.put_arena, put.span)
        self._puts = still
        lent, self._lent = self._lent, []
        for arena, span in lent:
            self._finish_span(arena, span)
        for fetch_id, span in list(self._rows_held.items()):
            if span.released.is_set():
                del self._rows_held[fetch_id]
                self._rows_returned[fetch_id] = 1

    def _finish_span(self, arena, span: _Span) -> None:
        """The step is done with `span`: freed now if its call returned, else
        once it has (`_reap`, every step)."""
        if span.free_now():
            arena.free(span.start)
        else:
            self._lent.append((arena, span))

    def close(self, timeout_s: float) -> int:
        """The engine is closing: start no call, drop the reads still queued,
        wait up to `timeout_s` for the calls that hold this engine's memory,
        and free what they held. Returns how many calls still hold some: their
        pool tensors and spans stay taken until they return, so nothing is
        written into memory a later engine was given."""
        if self._closed:
            return 0
        self._closed = True
        for pending in self._reads.values():
            if pending.future.cancel():
                pending.read.lease.release()
        for put in self._puts:
            if put.future.cancel():
                put.span.released.set()  # never handed to the store
        t_end = time.monotonic() + timeout_s
        spans = (
            [p.read.span for p in self._reads.values()]
            + list(self._rows_held.values())
            + [p.span for p in self._puts]
            + [span for _, span in self._lent]
        )
        events = {id(span.released): span.released for span in spans}
        for event in events.values():
            event.wait(max(0.0, t_end - time.monotonic()))
        # Verification may still run after a read's call released its memory;
        # cancelled or still running, the futures are given up below.
        for pending in list(self._reads.values()):
            with contextlib.suppress(Exception):
                pending.future.exception(max(0.0, t_end - time.monotonic()))
            pending.deadline = float("-inf")
        self._finish_reads()
        for put in self._puts:
            with contextlib.suppress(Exception):
                put.future.exception(max(0.0, t_end - time.monotonic()))
        self._reap()
        held = sum(not e.is_set() for e in events.values())
        for executor in (self._get_thread, self._put_thread, self._fp_thread):
            executor.shutdown(wait=False, cancel_futures=True)
        if held:
            self._count("store_calls_held_at_close", held)
            logger.warning(
                "chunk store: closing with %d store call(s) that have not "
                "returned within %.1f s; the memory they were given (pool "
                "tensors, %d bytes of host arenas) stays allocated until they "
                "return",
                held,
                timeout_s,
                self.lent_bytes(),
            )
        return held

    def shared_ready(self, timeout_s: float) -> bool:
        return self._shared.wait_connected(timeout_s)

    def lent_bytes(self) -> int:
        """Bytes of spans given to calls that have not returned."""
        return sum(span.nbytes for _, span in self._lent)

    def reads_into_pool(self) -> bool:
        """Reads land in the pool rows now (`direct_reads`, the pool reached)."""
        store = self._shared.get()
        return (
            store is not None
            and store.scatters
            and self._shared.pool_ready(self._pool_buffers)
        )

    # -------------------------------------------------------------- reads

    def _read_deadline(self, nbytes: int) -> float:
        expected = nbytes / self._read_bytes_per_s
        return min(
            self.spec.timeout_s + 1.0,
            max(self.spec.read_timeout_s, READ_SLACK * expected),
        )

    def _start_reads(self, fetches: list[EntryFetch]) -> None:
        """Every entry of a step in one call (Mooncake transfers them in
        parallel), on the get thread."""
        identity = self.identity
        direct = bool(fetches) and self.reads_into_pool()
        arena = self.get_arena
        # One call for the step's entries: their spans are released together.
        released = threading.Event()
        lease = _CallLease(released, [arena, *(self.tensors if direct else ())])
        items: list[tuple[str, _Read]] = []
        total = 0
        for fetch in fetches:
            entry = fetch.entry
            num_rows = len(entry.token_ids) - entry.virtual_start
            head = entry_format.header_nbytes(len(entry.token_ids))
            nbytes = entry_nbytes(len(entry.token_ids), num_rows, self.row_bytes)
            if (
                num_rows < 0
                or identity is None
                or identity.epoch != self.epoch
                or self.weights_changed
            ):
                self._outcomes[fetch.fetch_id] = FetchOutcome.ERROR
                continue
            parts = self._pool_parts(fetch.pool_block_ids, num_rows) if direct else None
            span_bytes = head + TAG_BYTES if direct else nbytes
            start = (
                None
                if arena is None
                else arena.allocate(span_bytes, tail_align_at=head)
            )
            if start is None:
                logger.warning(
                    "chunk store: no host room for a %d-byte read; computing it",
                    span_bytes,
                )
                self._count("store_reads_no_room")
                self._outcomes[fetch.fetch_id] = FetchOutcome.ERROR
                continue
            total += nbytes
            span = _Span(start, span_bytes, released)
            read = _Read(fetch, span, head, parts, lease, len(items))
            items.append((self._key(identity, entry), read))
        if not items:
            return
        # Fixed before the submit: the get thread reads it too.
        deadline = time.monotonic() + self._read_deadline(total)
        future = self._get_thread.submit(self._read, items, lease, deadline)
        for _, read in items:
            self._reads[read.fetch.fetch_id] = _Pending(read, future, deadline)

    def _hold_rows_if_lent(self, fetch_id: str, read: _Read) -> None:
        """A failed read into pool rows whose call has not returned: its rows
        are the store's until it does (reported lent now, returned by _reap)."""
        if read.parts is not None and not read.span.released.is_set():
            self._rows_held[fetch_id] = read.span
            self._rows_lent[fetch_id] = 1

    def _value_buffers(self, read: _Read) -> list[HostBuffer]:
        """Where the store writes `read`'s value, in the value's order."""
        base = self.get_arena.ptr + read.span.start
        if read.parts is None:
            return [HostBuffer(base, read.span.nbytes)]
        return [
            HostBuffer(base, read.head),
            *map(self._part_buffer, read.parts),
            HostBuffer(base + read.head, TAG_BYTES),
        ]

    def _read(
        self, items: list[tuple[str, _Read]], lease: _CallLease, deadline: float
    ) -> list[FetchOutcome]:
        t0 = time.monotonic()
        if t0 > deadline:
            # Queued behind a slow call past its deadline: the step computes
            # these documents anyway, so the store is not asked.
            lease.release()
            self._count("store_reads_never_started", len(items))
            return [FetchOutcome.TIMEOUT] * len(items)
        store = self._shared.get()
        if store is None:
            lease.release()
            return [FetchOutcome.ERROR] * len(items)
        keys = [key for key, _ in items]
        buffers = [self._value_buffers(read) for _, read in items]
        if items[0][1].parts is not None:
            codes = store.batch_get_into_parts(keys, buffers, lease.release)
        else:
            codes = store.batch_get_into(keys, [b[0] for b in buffers], lease.release)
        # The transfer alone, for the bytes/s figure; verification follows.
        seconds = time.monotonic() - t0
        got = sum(max(0, int(c)) for c in codes)
        self._count("store_get_seconds", seconds)
        self._count("store_get_bytes", got)
        if got and all(c >= 0 for c in codes) and seconds > 0:
            # Read by the step thread for deadlines; a float store is atomic.
            self._read_bytes_per_s = 0.7 * self._read_bytes_per_s + 0.3 * (
                got / seconds
            )
            self._bandwidth_news = True
        out = []
        for code, (key, read), value in zip(codes, items, buffers):
            if code < 0:
                out.append(_MISS_OF_CODE.get(code, FetchOutcome.ERROR))
            elif code != sum(b.nbytes for b in value):
                out.append(FetchOutcome.VERIFY_FAILED)
            else:
                out.append(self._verify(key, read))
        return out

    def _verify(self, key: str, read: _Read) -> FetchOutcome:
        entry, span, head = read.fetch.entry, read.span, read.head
        value = self.get_arena.bytes_view(span.start, span.nbytes)
        if read.parts is None:
            rows = [value[head : span.nbytes - TAG_BYTES]]
        else:
            rows = [self._part_bytes(part) for part in read.parts]
        tag = value[span.nbytes - TAG_BYTES :]
        payload = sum(r.nbytes for r in rows) + TAG_BYTES
        result = entry_format.verify_parts(
            value[:head],
            [*rows, tag],
            list(entry.token_ids),
            entry.virtual_start,
            payload,
        )
        mac_header = entry_format.header_for_mac(value[:head])
        if not result.ok:
            why = f"{result.cause}: {result.detail}"
        elif not self.seal.matches(tag, key, mac_header, rows):
            why = "a tag not its key's: a value written under another key" + (
                ", or without the fleet's secret" if self.seal.authenticated else ""
            )
        else:
            return FetchOutcome.OK
        logger.warning("chunk store: entry %s failed verification (%s)", key, why)
        return FetchOutcome.VERIFY_FAILED

    def _finish_reads(self) -> None:
        now = time.monotonic()
        for fetch_id, pending in list(self._reads.items()):
            read, future, late = pending.read, pending.future, now > pending.deadline
            if late and future.cancel():
                # Still queued behind another call (the step's other reads
                # share the future): it never reached the store.
                read.lease.release()
            never_started = future.cancelled()
            if never_started or (late and not future.done()):
                # Computed instead; the span (and pool rows) stay the call's
                # until it returns, and their bytes are never used.
                del self._reads[fetch_id]
                self._outcomes[fetch_id] = FetchOutcome.TIMEOUT
                self._count("store_reads_given_up")
                if never_started:
                    self._count("store_reads_never_started")
                self._hold_rows_if_lent(fetch_id, read)
                self._finish_span(self.get_arena, read.span)
                logger.warning(
                    "chunk store: read of %s %s; computing it%s",
                    fetch_id,
                    "waited past its deadline behind another store call"
                    if never_started
                    else "did not land by its deadline",
                    " (its pool rows stay the store's until the call returns)"
                    if fetch_id in self._rows_held
                    else "",
                )
                continue
            if not future.done():
                continue
            del self._reads[fetch_id]
            try:
                outcome = future.result()[read.index]
            except Exception as e:  # any failure is a miss
                logger.warning("chunk store: read of %s failed: %s", fetch_id, e)
                outcome = FetchOutcome.ERROR
            if outcome is FetchOutcome.OK and not read.span.released.is_set():
                # A call that returned OK has released: a span still lent is
                # never read from.
                outcome = FetchOutcome.ERROR
            if outcome is FetchOutcome.OK and read.parts is not None:
                # The rows landed in place and were verified there.
                self._count("store_gets")
                self._count("store_gets_into_pool")
            elif outcome is FetchOutcome.OK:
                entry = read.fetch.entry
                num_rows = len(entry.token_ids) - entry.virtual_start
                rows = self._rows(read.fetch.pool_block_ids, num_rows)
                for t, src in zip(
                    self.tensors,
                    self._payload_views(
                        self.get_arena, read.span.start + read.head, num_rows
                    ),
                ):
                    t.index_copy_(0, rows, src.to(t.device, non_blocking=True))
                read.span.fence = copy_fence(self.tensors[0].device)
                self._count("store_gets")
            else:
                # The store answers TIMEOUT while its call may still run.
                self._hold_rows_if_lent(fetch_id, read)
                logger.info(
                    "chunk store: %s not served from the store (%s); computing it",
                    fetch_id,
                    outcome.value,
                )
            self._finish_span(self.get_arena, read.span)
            self._outcomes[fetch_id] = outcome
