# SPDX-License-Identifier: Apache-2.0
"""A worker's side of the fleet-wide chunk store (issue 31, 39).

Per step (`on_step`, at the start of `start_load_kv`, before any load):

1. a new epoch: the weights are fingerprinted again on a thread of their own
   (store/weights.py), never on the step; this rank's identity (the part of
   every key only it knows) is reported once that is done;
2. puts: the rows of each finished child's entry are copied from the pool
   into the put arena now, before anything can reuse them; the key, tag and
   header are made and the value written on the put thread;
3. fetches that finished: verified on the get thread (header, tokens,
   checksum, tag: entry_format.decode_and_verify, integrity.py), written here
   into the pool rows the scheduler allocated; each outcome goes to the
   scheduler in this step's worker metadata (`take_report`), combined over
   all ranks: the scheduler serves an entry only when every rank read and
   verified its own key;
4. new fetches are read on the get thread into the get arena; with the
   spec's `direct_reads=1` (a host pool and Mooncake's client in this
   process) straight into the pool rows the scheduler allocated instead (only
   the header and the tag go to the get arena).

NOTE (issue 50): the arena by default. A get Mooncake fails in transfer is
retired (mooncake.py: its transport may still write into what it was given),
in process and through the node's client alike. Read into the arena, that
costs the span (never reused; an exhausted arena is a miss: "no host room for
a read"); read into the pool, it cost the pool rows until `held_limit` wrote
them off, for good (the in-process soak stalled, or refused 158 of 500 with
held_limit=30). And the pool is written only on the step, from bytes that a
call that transferred everything left in a span no other call is given.

NOTE (issue 39, finding 1): an arena span given to a store call is freed only
when that call has returned (its `on_release`), never at a deadline: a read
the step gave up on may still be written into by Mooncake, and its span reused
by a put would be stored, checksummed, with the late read's bytes in it.
The same holds for pool rows (finding 9): a read into pool rows given up on
reports them lent (`StoreReport.rows_lent`), and the scheduler hands those
blocks to no one until this rank reports them returned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from vllm.logger import init_logger

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import (
    POOL_BLOCK_SIZE,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import entry_format
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.base import (
    HostBuffer,
    StoreCode,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.connection import (
    SharedStore,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.integrity import (
    TAG_BYTES,
    EntrySeal,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.lora_loads import (
    LOADED_SEP,
    LoadedLoras,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.messages import (
    EntryFetch,
    EntryPut,
    EntryRef,
    FetchOutcome,
    RankIdentity,
    StoreReport,
    StoreStep,
    store_key_for,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.rank import (
    StoreRank,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.weights import (
    weights_fingerprint,
)

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


# What _put returns for an entry it did not store (no key: its epoch's
# fingerprint was cancelled by a later reset).
_SKIPPED = None


def entry_nbytes(num_tokens: int, num_rows: int, row_bytes: int) -> int:
    """Header + rows + tag of an entry of `num_tokens` header tokens."""
    return entry_format.header_nbytes(num_tokens) + num_rows * row_bytes + TAG_BYTES


def default_arena_bytes(max_chunk_tokens: int, row_bytes: int) -> int:
    """Two of the largest entries (a segment of --max-chunk-tokens after a
    context as long), at least MIN_ARENA_BYTES, per kind of call."""
    largest = entry_nbytes(2 * max_chunk_tokens, max_chunk_tokens, row_bytes)
    return max(MIN_ARENA_BYTES, 2 * largest + 2 * 64)


def copy_fence(device: torch.device):
    """An event recorded after the copies just issued on `device`'s current
    stream, or None where copies are synchronous (CPU). NOTE: on a GPU the
    copies between the pool and the pinned arena are issued non-blocking, so
    the step does not stall on them; the put thread waits on the event before
    it reads the bytes, and a read's span is freed only once its copy into the
    pool is done (not executed here)."""
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
    fence: object = None

    def free_now(self) -> bool:
        return self.released.is_set() and (self.fence is None or self.fence.query())


class _CallLease:
    """What one store call was given that must outlive the call: the event
    its spans wait on and, for a read into pool rows, the pool tensors.

    NOTE (issue 50, finding 1): Mooncake holds raw pointers into the pool
    until its call returns. An engine closed meanwhile (`del llm`, a framework
    that recreates engines) would free the pool, the next engine's pool could
    land at the same addresses, and the late write would scatter into its rows
    (served unchecked) or into unmapped memory. The lease is the store call's
    `on_release`, so whatever holds the call (Mooncake's lane) holds the
    tensors, and `release` lets them go when the call has returned."""

    __slots__ = ("released", "_keep")

    def __init__(self, released: threading.Event, keep: list[object] | None):
        self.released = released
        # NOTE: the host arena the call's spans are in too: a process's
        # arenas live as long as its SharedStore, which need not outlive
        # this engine (a SharedStore of its own, as in tests).
        self._keep = keep

    def release(self) -> None:
        self._keep = None
        self.released.set()


@dataclass(frozen=True)
class _PoolPart:
    """Rows [first_row, first_row + num_rows) of one pool tensor: a piece of
    an entry's payload where it lives in the pool."""

    tensor: int
    first_row: int
    num_rows: int


@dataclass
class _Read:
    fetch: EntryFetch
    span: _Span
    head: int
    # Where the payload landed: the pool rows (a direct read; the span holds
    # the header and the tag only), or None (the span holds all of it).
    parts: list[_PoolPart] | None
    # One call reads every entry of a step: its outcomes, this one's index.
    future: Future
    index: int
    deadline: float
    lease: _CallLease | None = None


@dataclass
class _Put:
    future: Future
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
        # The payload: each tensor's rows of the entry, tensor after tensor
        # in name order, then the seal's tag.
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
                f"--chunk-store arena={arena_bytes} bytes cannot hold one entry of "
                f"--max-chunk-tokens {rank.max_chunk_tokens} tokens ({self.max_entry_bytes} "
                f"bytes for this model on this rank): give at least that, or leave arena "
                f"out to size it from the model"
            )
        # NOTE: reads and writes have arenas of their own: a burst of writes
        # never leaves a read without room (reads come first).
        shared.want_arenas(arena_bytes)
        # A host pool the connection can reach takes its reads directly, when
        # the spec asks for it (direct_reads).
        self._pool_buffers = (
            [
                HostBuffer(t.data_ptr(), t.nbytes)
                for t in self.tensors
                if t.device.type == "cpu" and t.is_contiguous()
            ]
            if self.spec.direct_reads
            else []
        )
        # NOTE: each tensor's bytes as numpy, made here: the get thread
        # verifies rows in place through numpy slices only. With torch views
        # made on the get thread, verification did not finish in the engine's
        # process (test_chunk_store.py's second replica: 4 runs of 5 gave up
        # at the read deadline after a 50 ms transfer; cause not found).
        self._pool_bytes = []
        if len(self._pool_buffers) == len(self.tensors):
            shared.want_pool(self._pool_buffers)
            self._pool_bytes = [
                t.reshape(-1).view(torch.uint8).numpy() for t in self.tensors
            ]
        else:
            self._pool_buffers = []
        self._get_thread = ThreadPoolExecutor(1, thread_name_prefix="chunk-store-get")
        self._put_thread = ThreadPoolExecutor(1, thread_name_prefix="chunk-store-put")
        self._fp_thread = ThreadPoolExecutor(
            1, thread_name_prefix="chunk-store-weights"
        )
        self.epoch = -1
        # The identity of `epoch`: made on the fingerprint thread.
        self._identity: Future[RankIdentity] | None = None
        self._identity_reported = False
        self._reads: dict[str, _Read] = {}
        # Fetches whose pool rows a given-up read's call still holds, and
        # what this step reports lent / returned (the scheduler's side).
        self._rows_held: dict[str, _Span] = {}
        self._rows_lent: dict[str, int] = {}
        self._rows_returned: dict[str, int] = {}
        # Spans whose step is done but whose call has not returned yet.
        self._lent: list[tuple[object, _Span]] = []
        self._outcomes: dict[str, FetchOutcome] = {}
        self._puts: list[_Put] = []
        self._read_bytes_per_s = float(INITIAL_READ_BYTES_PER_S)
        # A new measurement since the last report (sent up for ReadCost).
        self._bandwidth_news = False
        self.counters: dict[str, float] = {}
        self._reported: dict[str, float] = {}
        self._counter_lock = threading.Lock()
        # Set when the model's load_weights runs (weight sync, reload) and
        # cleared at the next epoch (the reset that must follow a weight update).
        self.weights_changed = False
        self._closed = False
        self._watch_weight_loads(model)
        # The LoRA adapters this rank loaded, by what it loaded (finding 6).
        self.loras = LoadedLoras()
        self.loras.watch(model)
        shared.start_connecting()
        self._new_epoch(0)

    def _watch_weight_loads(self, model: nn.Module) -> None:
        """NOTE (issue 39, finding 10): vLLM's weight-update paths (reload_weights,
        the RL trainers' weight syncs through collective_rpc) load through the
        model's `load_weights`. Until the reset that must follow, this rank's
        keys still carry the old weights' fingerprint: a put would spread KV of
        the new weights under the old version to every replica, a read would
        bring the old weights' KV. So both stop until the next epoch. Weights
        written by other means are not seen: reset after any change (vLLM's
        prefix cache asks the same)."""
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
        return cls(
            StoreRank.from_engine(vllm_config, model),
            SharedStore.of(spec_text),
            model,
            tensors,
            kv_dtype,
        )

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
        return (
            f.result() if f is not None and f.done() and f.exception() is None else None
        )

    # --------------------------------------------------------------- step

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
        # NOTE: the store threads count too.
        with self._counter_lock:
            self.counters[name] = self.counters.get(name, 0) + value

    def _new_epoch(self, epoch: int) -> None:
        """Fingerprint the weights of `epoch` off the step (vLLM resets the
        cache after a weight update: the next epoch's weights are in place)."""
        self.epoch = epoch
        self.weights_changed = False
        self._identity_reported = False
        # NOTE (issue 50, finding 9): a fingerprint not yet started is of no
        # use once superseded, and each is a full hash of the weights: resets
        # faster than a hash queued them without bound. A running one cannot
        # be stopped; so at most one runs and one waits.
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

    def _rows(
        self, pool_block_ids: tuple[int, ...], num_rows: int, device
    ) -> torch.Tensor:
        blocks = torch.tensor(pool_block_ids, dtype=torch.int64)
        rows = (
            blocks[:, None] * POOL_BLOCK_SIZE + torch.arange(POOL_BLOCK_SIZE)[None, :]
        ).reshape(-1)[:num_rows]
        return rows.to(device)

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

    def _store(self):
        """The connection with both arenas registered, or None (not yet)."""
        return self._shared.get()

    # --------------------------------------------------------------- puts

    def _start_put(self, put: EntryPut) -> None:
        if self.weights_changed:
            self._count("store_puts_skipped")
            return
        entry = put.entry
        if entry.lora and not self.loras.holds(entry.lora.rpartition(LOADED_SEP)[2]):
            # NOTE (issue 50, finding 6): the adapter the scheduler keyed the entry by
            # is not what this rank holds now (reloaded since): never written.
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
        rows = self._rows(put.pool_block_ids, num_rows, self.tensors[0].device)
        for t, dst in zip(
            self.tensors, self._payload_views(self.put_arena, start + head, num_rows)
        ):
            # NOTE: copied now, inside the step: the pool rows may be given to
            # another entry from the next step on.
            dst.copy_(t.index_select(0, rows), non_blocking=True)
        span = _Span(start, nbytes, fence=copy_fence(self.tensors[0].device))
        identity = self._identity
        assert identity is not None
        self._puts.append(
            _Put(self._put_thread.submit(self._put, identity, entry, span, head), span)
        )

    def _put(self, identity: Future, entry: EntryRef, span: _Span, head: int) -> int:
        # NOTE: the entry was computed in this epoch: its key waits for the
        # epoch's fingerprint (on this thread, never on the step).
        try:
            key = self._key(identity.result(), entry)
        except CancelledError:
            # A reset came before this epoch's fingerprint ran (_new_epoch
            # cancelled it): the entry has no key; it is not stored.
            span.released.set()
            return _SKIPPED
        if span.fence is not None:
            span.fence.synchronize()  # the rows' copy into the arena
        payload = span.nbytes - head
        # NOTE: numpy views only on the store threads (HostArena.bytes_view).
        body = self.put_arena.bytes_view(span.start + head, payload)
        # NOTE: the tag covers the header but its checksum, which covers the tag.
        mac_header = entry_format.header_for_mac(
            entry_format.encode_header(
                entry_format.EntryHeader(
                    entry_format.FORMAT_VERSION,
                    int(entry.virtual_start),
                    tuple(int(t) for t in entry.token_ids),
                    payload,
                    0,
                )
            )
        )
        body[payload - TAG_BYTES :] = memoryview(
            self.seal.tag_of_parts(key, mac_header, [body[: payload - TAG_BYTES]])
        )
        header = entry_format.encode_header(
            entry_format.make_header(entry.virtual_start, entry.token_ids, body)
        )
        self.put_arena.bytes_view(span.start, head)[:] = memoryview(header)
        store = self._store()
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
            except Exception as e:  # noqa: BLE001
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
        """The step is done with `span`: free it now if its call returned,
        else once it has (`_reap`, every step)."""
        if span.free_now():
            arena.free(span.start)
        else:
            self._lent.append((arena, span))

    def close(self, timeout_s: float) -> int:
        """The engine is closing: start no call, drop the reads still queued,
        wait up to `timeout_s` for the store calls that hold this engine's
        memory (pool rows, spans of the process's arenas) to return, and free
        what they held. Returns how many calls still hold some when the wait
        ends: their pool tensors stay allocated (each call's lease) and their
        spans stay taken until they return, so nothing is written into memory
        a later engine was given (issue 50, finding 1)."""
        if self._closed:
            return 0
        self._closed = True
        for read in self._reads.values():
            if read.future.cancel():
                read.lease.release()
        for put in self._puts:
            if put.future.cancel():
                put.span.released.set()  # never handed to the store
        t_end = time.monotonic() + timeout_s
        spans = (
            [r.span for r in self._reads.values()]
            + list(self._rows_held.values())
            + [p.span for p in self._puts]
            + [span for _, span in self._lent]
        )
        events = {id(span.released): span.released for span in spans}
        for event in events.values():
            event.wait(max(0.0, t_end - time.monotonic()))
        # Verification may still run after a read's call released its memory.
        for read in list(self._reads.values()):
            try:
                read.future.exception(max(0.0, t_end - time.monotonic()))
            except Exception:  # noqa: BLE001 - cancelled, or still running: given up below
                pass
            read.deadline = float("-inf")
        self._finish_reads()
        for put in self._puts:
            try:
                put.future.exception(max(0.0, t_end - time.monotonic()))
            except Exception:  # noqa: BLE001 - cancelled, or still running: held
                pass
        self._reap()
        held = sum(not e.is_set() for e in events.values())
        for executor in (self._get_thread, self._put_thread, self._fp_thread):
            executor.shutdown(wait=False, cancel_futures=True)
        if held:
            self._count("store_calls_held_at_close", held)
            logger.warning(
                "chunk store: closing with %d store call(s) that have not returned within "
                "%.1f s; the memory they were given (pool tensors, %d bytes of host "
                "arenas) stays allocated until they return",
                held,
                timeout_s,
                self.lent_bytes(),
            )
        return held

    def shared_ready(self, timeout_s: float) -> bool:
        """Tests and tools: wait until the connection is made."""
        return self._shared.wait_connected(timeout_s)

    def lent_bytes(self) -> int:
        """Bytes of spans given to calls that have not returned (tests, metrics)."""
        return sum(span.nbytes for _, span in self._lent)

    def reads_into_pool(self) -> bool:
        """Reads land in the pool rows now: the connection reaches the pool's
        buffers, which exist only with `direct_reads=1` (see __init__)."""
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
        """Every entry of a step in one batch_get_into (Mooncake transfers them
        in parallel), on the get thread."""
        identity = self.identity
        direct = bool(fetches) and self.reads_into_pool()
        items = []
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
            # NOTE: a direct read's span holds the header and the tag only.
            span_bytes = head + TAG_BYTES if direct else nbytes
            arena = self.get_arena
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
            read = _Read(fetch, _Span(start, span_bytes), head, parts, None, 0, 0.0)
            items.append((self._key(identity, entry), read))
        if not items:
            return
        released = threading.Event()
        lease = _CallLease(
            released, [self.get_arena, *(self.tensors if direct else ())]
        )
        for _, read in items:
            # One call for the step's entries: they are released together.
            read.span.released = released
            read.lease = lease
        total = sum(
            entry_nbytes(
                len(r.fetch.entry.token_ids),
                len(r.fetch.entry.token_ids) - r.fetch.entry.virtual_start,
                self.row_bytes,
            )
            for _, r in items
        )
        # NOTE: fixed before the submit: the get thread reads it too (_read).
        deadline = time.monotonic() + self._read_deadline(total)
        future = self._get_thread.submit(self._read, items, lease, deadline)
        for index, (_, read) in enumerate(items):
            read.future, read.index, read.deadline = future, index, deadline
            self._reads[read.fetch.fetch_id] = read

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
            # NOTE (issue 50, finding 5): queued behind a slow call past its
            # deadline: the step computes these documents whatever we do now,
            # so the store is not asked (no call holds the span or the rows).
            lease.release()
            self._count("store_reads_never_started", len(items))
            return [FetchOutcome.TIMEOUT] * len(items)
        store = self._store()
        if store is None:
            lease.release()
            return [FetchOutcome.ERROR] * len(items)
        keys = [key for key, _ in items]
        if items[0][1].parts is not None:
            codes = store.batch_get_into_parts(
                keys,
                [self._value_buffers(read) for _, read in items],
                on_release=lease.release,
            )
        else:
            codes = store.batch_get_into(
                keys,
                [self._value_buffers(read)[0] for _, read in items],
                on_release=lease.release,
            )
        # NOTE: the transfer alone (one call for the step's entries), for the
        # bytes/s figure; verification follows.
        seconds = time.monotonic() - t0
        got = sum(max(0, int(c)) for c in codes)
        self._count("store_get_seconds", seconds)
        self._count("store_get_bytes", got)
        if got and all(c >= 0 for c in codes) and seconds > 0:
            # NOTE: read by the step thread for deadlines; a float store is atomic.
            self._read_bytes_per_s = 0.7 * self._read_bytes_per_s + 0.3 * (
                got / seconds
            )
            self._bandwidth_news = True
        out = []
        for code, (key, read) in zip(codes, items):
            if code < 0:
                out.append(
                    {
                        StoreCode.ABSENT: FetchOutcome.ABSENT,
                        StoreCode.TIMEOUT: FetchOutcome.TIMEOUT,
                    }.get(code, FetchOutcome.ERROR)
                )
            elif code != sum(b.nbytes for b in self._value_buffers(read)):
                out.append(FetchOutcome.VERIFY_FAILED)
            else:
                out.append(self._verify(key, read))
        return out

    def _verify(self, key: str, read: _Read) -> FetchOutcome:
        entry, span, head = read.fetch.entry, read.span, read.head
        # NOTE: numpy, made when the arena was: no torch view on this thread
        # (see the pool's bytes in __init__).
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
        if not result.ok:
            logger.warning(
                "chunk store: entry %s failed verification (%s: %s)",
                key,
                result.cause,
                result.detail,
            )
            return FetchOutcome.VERIFY_FAILED
        if not self.seal.matches(
            tag, key, entry_format.header_for_mac(value[:head]), rows
        ):
            logger.warning(
                "chunk store: entry %s carries a tag that is not its key's (a "
                "value written under another key%s)",
                key,
                ", or without the fleet's secret" if self.seal.authenticated else "",
            )
            return FetchOutcome.VERIFY_FAILED
        return FetchOutcome.OK

    def _finish_reads(self) -> None:
        now = time.monotonic()
        for fetch_id, read in list(self._reads.items()):
            if now > read.deadline and read.future.cancel():
                # NOTE (issue 50, finding 5): still queued behind another call
                # (its deadline counts from submit): it never reached the store,
                # so nothing holds its span or its rows. Its step's other
                # reads share the future and see it cancelled below.
                read.lease.release()
            if read.future.cancelled():
                del self._reads[fetch_id]
                self._outcomes[fetch_id] = FetchOutcome.TIMEOUT
                self._count("store_reads_given_up")
                self._count("store_reads_never_started")
                self._finish_span(self.get_arena, read.span)
                logger.warning(
                    "chunk store: read of %s waited past its deadline behind "
                    "another store call; computing it",
                    fetch_id,
                )
                continue
            if not read.future.done():
                if now > read.deadline:
                    # NOTE: the document is computed instead; the span stays the
                    # call's until it returns, and its bytes are never used.
                    del self._reads[fetch_id]
                    self._outcomes[fetch_id] = FetchOutcome.TIMEOUT
                    self._count("store_reads_given_up")
                    self._hold_rows_if_lent(fetch_id, read)
                    self._finish_span(self.get_arena, read.span)
                    logger.warning(
                        "chunk store: read of %s did not land by its deadline; "
                        "computing it%s",
                        fetch_id,
                        " (its pool rows stay the store's until the call returns)"
                        if fetch_id in self._rows_held
                        else "",
                    )
                continue
            del self._reads[fetch_id]
            try:
                outcome = read.future.result()[read.index]
            except Exception as e:  # noqa: BLE001 - any failure is a miss
                logger.warning("chunk store: read of %s failed: %s", fetch_id, e)
                outcome = FetchOutcome.ERROR
            if outcome is FetchOutcome.OK and not read.span.released.is_set():
                # A call that returned OK has released; this cannot happen, but
                # a span still lent is never read from.
                outcome = FetchOutcome.ERROR
            if outcome is FetchOutcome.OK and read.parts is not None:
                # The rows landed in place and were verified there.
                self._count("store_gets")
                self._count("store_gets_into_pool")
            elif outcome is FetchOutcome.OK:
                entry = read.fetch.entry
                num_rows = len(entry.token_ids) - entry.virtual_start
                rows = self._rows(
                    read.fetch.pool_block_ids, num_rows, self.tensors[0].device
                )
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
                # NOTE: the store answers TIMEOUT while its call may still run.
                self._hold_rows_if_lent(fetch_id, read)
                logger.info(
                    "chunk store: %s not served from the store (%s); computing it",
                    fetch_id,
                    outcome.value,
                )
            self._finish_span(self.get_arena, read.span)
            self._outcomes[fetch_id] = outcome
