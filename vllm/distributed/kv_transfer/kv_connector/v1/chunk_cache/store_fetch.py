# SPDX-License-Identifier: Apache-2.0
"""A worker's side of the fleet-wide chunk store (issue 31).

Per step (`on_step`, at the start of `start_load_kv`, before any load):

1. a new epoch: fingerprint the weights again (weights_fingerprint.py) and
   report this rank's identity, the part of every key only it knows;
2. puts: the rows of each finished child's entry are copied from the pool
   into host memory (HostArena) now, before anything can reuse them; the
   header (tokens, virtual start, checksum) is built and the value written
   to the store on the put thread, never blocking a step;
3. fetches that finished: verified on the fetch thread (header, tokens,
   checksum: entry_format.decode_and_verify), written here into the pool
   rows the scheduler allocated; each outcome ("" or a miss cause) goes to
   the scheduler in this step's worker metadata (`take_report`), combined
   over all ranks: the scheduler serves an entry only when every rank read
   and verified its own key;
4. new fetches are read on the fetch thread, into the arena.

A read that has not finished after the deadline is reported `timeout` (its
host span is freed when the call returns); nothing is ever waited for here.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from torch import nn

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.setup import POOL_BLOCK_SIZE
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store_client import (
    SharedStore,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store_messages import (
    CAUSE_ABSENT,
    CAUSE_ERROR,
    CAUSE_TIMEOUT,
    CAUSE_VERIFY_FAILED,
    FETCH_OK,
    EntryFetch,
    EntryPut,
    EntryRef,
    RankIdentity,
    StoreReport,
    StoreStep,
    store_key_for,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.weights_fingerprint import (
    weights_fingerprint,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# Host memory for entries in flight (reads and writes), per worker.
ARENA_BYTES = 256 << 20
# The payload ends with xxh3-128 of the entry's own key: the header's
# checksum covers it, so a value copied under another key (another model,
# weights version, rank or tenant: a forged key) fails verification.
KEY_TAG_BYTES = 16


def key_tag(key: str) -> bytes:
    return xxhash.xxh3_128(key.encode()).digest()


def entry_header(token_ids: list[int], virtual_start: int, payload) -> bytes:
    """The header of an entry whose payload is `payload` (entry_format)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store import entry_format

    return entry_format.encode_header(
        entry_format.make_header(virtual_start, token_ids, payload))


@dataclass
class _Read:
    fetch: EntryFetch
    start: int
    nbytes: int
    # One call reads every entry of a step: its outcomes, this one's index.
    future: Future
    index: int
    started: float


class StoreTransfers:
    def __init__(self, vllm_config: VllmConfig, model: nn.Module,
                 tensors: dict[str, torch.Tensor], kv_dtype: str):
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.spec import (
            parse_store_spec,
        )
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        spec_text = vllm_config.chunk_cache_config.chunk_store
        assert spec_text is not None
        self.timeout_s = parse_store_spec(spec_text).timeout_s
        self._shared = SharedStore.of(spec_text)
        parallel = vllm_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        self.tp_rank = get_tp_group().rank_in_group
        self.pp_rank = get_pp_group().rank_in_group
        self.model = model
        self.model_name = str(vllm_config.model_config.served_model_name)
        self.kv_dtype = kv_dtype
        # The payload: each tensor's rows of the entry, tensor after tensor
        # in name order.
        self.names = sorted(tensors)
        self.tensors = [tensors[n] for n in self.names]
        self.row_bytes = sum(t[0].numel() * t.element_size() for t in self.tensors)
        self.kv_layout = ";".join(
            f"{n}:{tuple(t.shape[1:])}:{t.dtype}" for n, t in zip(self.names, self.tensors))
        hf = vllm_config.model_config.hf_text_config
        self.rope = json.dumps({
            k: getattr(hf, k, None)
            for k in ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
                      "max_position_embeddings")
        }, sort_keys=True, default=str)
        self.arena = self._shared.arena(ARENA_BYTES)
        self._get_thread = ThreadPoolExecutor(1, thread_name_prefix="chunk-store-get")
        self._put_thread = ThreadPoolExecutor(1, thread_name_prefix="chunk-store-put")
        self.epoch = -1
        self.identity: RankIdentity | None = None
        self._new_identity = False
        self._reads: dict[str, _Read] = {}
        # Reads given up on (timeout) whose call has not returned yet.
        self._abandoned: list[_Read] = []
        self._outcomes: dict[str, str] = {}
        self._puts: list[tuple[Future, int, int]] = []
        self.counters: dict[str, float] = {}
        self._reported: dict[str, float] = {}
        self._counter_lock = threading.Lock()

    # --------------------------------------------------------------- step

    def on_step(self, step: StoreStep) -> None:
        if step.epoch != self.epoch:
            self._new_epoch(step.epoch)
        for put in step.puts:
            self._start_put(put)
        self._finish_reads()
        self._start_reads(step.fetches)
        self._reap()

    def take_report(self) -> StoreReport | None:
        report = StoreReport(outcomes={k: [v] for k, v in self._outcomes.items()})
        self._outcomes = {}
        if self._new_identity and self.identity is not None:
            report.identities.append(self.identity)
            self._new_identity = False
        return None if report.is_empty() else report

    def take_counters(self) -> dict[str, float]:
        """Increments of the (cumulative) counters since the last call."""
        with self._counter_lock:
            now = dict(self.counters)
        last, self._reported = self._reported, now
        return {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}

    def _count(self, name: str, value: float = 1) -> None:
        # NOTE: the fetch thread counts too.
        with self._counter_lock:
            self.counters[name] = self.counters.get(name, 0) + value

    def _new_epoch(self, epoch: int) -> None:
        t0 = time.monotonic()
        version = weights_fingerprint(self.model)
        self.epoch = epoch
        self.identity = RankIdentity(
            epoch=epoch, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
            model=self.model_name, weights_version=version, kv_dtype=self.kv_dtype,
            kv_layout=self.kv_layout, rope=self.rope)
        self._new_identity = True
        logger.info("chunk store: epoch %d, weights version %s (rank tp%d/pp%d, %.2f s)",
                    epoch, version[:16], self.tp_rank, self.pp_rank,
                    time.monotonic() - t0)

    def _key(self, entry: EntryRef) -> str:
        assert self.identity is not None
        return store_key_for(self.identity, self.tp_size, self.pp_size, entry)

    def _rows(self, pool_block_ids: tuple[int, ...], num_rows: int, device) -> torch.Tensor:
        blocks = torch.tensor(pool_block_ids, dtype=torch.int64)
        rows = (blocks[:, None] * POOL_BLOCK_SIZE
                + torch.arange(POOL_BLOCK_SIZE)[None, :]).reshape(-1)[:num_rows]
        return rows.to(device)

    def _payload_views(self, start: int, num_rows: int) -> list[torch.Tensor]:
        views, off = [], start
        for t in self.tensors:
            n = num_rows * t[0].numel() * t.element_size()
            views.append(self.arena.view(off, n).view(t.dtype).view(num_rows, *t.shape[1:]))
            off += n
        return views

    def _store(self):
        """The connection, with the arena registered (store threads only)."""
        return self._shared.get()

    # --------------------------------------------------------------- puts

    def _start_put(self, put: EntryPut) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.entry_format import (
            header_nbytes,
        )

        entry = put.entry
        num_rows = len(entry.token_ids) - entry.virtual_start
        head = header_nbytes(len(entry.token_ids))
        payload = num_rows * self.row_bytes + KEY_TAG_BYTES
        start = self.arena.allocate(head + payload, tail_align_at=head)
        if start is None:
            self._count("store_puts_skipped")
            return
        rows = self._rows(put.pool_block_ids, num_rows, self.tensors[0].device)
        for t, dst in zip(self.tensors, self._payload_views(start + head, num_rows)):
            # NOTE: copied now, inside the step: the pool rows may be given to
            # another entry from the next step on.
            dst.copy_(t.index_select(0, rows))
        key = self._key(entry)
        self._puts.append((self._put_thread.submit(
            self._put, key, entry, start, head, payload), start, head + payload))

    def _put(self, key: str, entry: EntryRef, start: int, head: int, payload: int) -> int:
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.base import (
            HostBuffer,
        )
        body = self.arena.view(start + head, payload).numpy()
        body[payload - KEY_TAG_BYTES:] = memoryview(key_tag(key))
        header = entry_header(list(entry.token_ids), entry.virtual_start, body)
        self.arena.view(start, head).numpy()[:] = memoryview(header)
        store = self._store()
        if store is None:
            return -1
        return store.batch_put_from([key], [HostBuffer(self.arena.ptr + start, head + payload)])[0]

    def _reap(self) -> None:
        still = []
        for future, start, nbytes in self._puts:
            if not future.done():
                still.append((future, start, nbytes))
                continue
            self.arena.free(start)
            try:
                code = future.result()
            except Exception as e:  # noqa: BLE001
                logger.warning("chunk store: put failed: %s", e)
                code = -1
            if code == 0:
                self._count("store_puts")
                self._count("store_put_bytes", nbytes)
            else:
                self._count("store_put_failures")
        self._puts = still
        for read in [r for r in self._abandoned if r.future.done()]:
            self._abandoned.remove(read)
            self.arena.free(read.start)

    # -------------------------------------------------------------- reads

    def _start_reads(self, fetches: list[EntryFetch]) -> None:
        """Every entry of a step in one batch_get_into (Mooncake transfers them
        in parallel), on the fetch thread."""
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.entry_format import (
            header_nbytes,
        )

        items = []
        for fetch in fetches:
            entry = fetch.entry
            num_rows = len(entry.token_ids) - entry.virtual_start
            head = header_nbytes(len(entry.token_ids))
            nbytes = head + num_rows * self.row_bytes + KEY_TAG_BYTES
            start = self.arena.allocate(nbytes, tail_align_at=head)
            if num_rows < 0 or self.epoch < 0 or start is None:
                logger.warning("chunk store: no host room for a %d-byte read; computing it",
                               nbytes)
                self._outcomes[fetch.fetch_id] = CAUSE_ERROR
                continue
            items.append((fetch, self._key(entry), start, head, nbytes))
        if not items:
            return
        future = self._get_thread.submit(
            self._read, [(key, fetch.entry, start, head, nbytes)
                         for fetch, key, start, head, nbytes in items])
        now = time.monotonic()
        for index, (fetch, _, start, _, nbytes) in enumerate(items):
            self._reads[fetch.fetch_id] = _Read(fetch, start, nbytes, future, index, now)

    def _read(self, items: list[tuple[str, EntryRef, int, int, int]]) -> list[str]:
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.base import (
            HostBuffer,
            StoreCode,
        )

        t0 = time.monotonic()
        store = self._store()
        if store is None:
            return [CAUSE_ERROR] * len(items)
        codes = store.batch_get_into(
            [key for key, *_ in items],
            [HostBuffer(self.arena.ptr + start, nbytes) for _, _, start, _, nbytes in items])
        # NOTE: the transfer alone (one call for the step's entries), for the
        # bytes/s figure; verification follows.
        self._count("store_get_seconds", time.monotonic() - t0)
        self._count("store_get_bytes", sum(max(0, int(c)) for c in codes))
        out = []
        for got, (key, entry, start, head, nbytes) in zip(codes, items):
            if got < 0:
                if got == StoreCode.ABSENT:
                    out.append(CAUSE_ABSENT)
                elif got == StoreCode.TIMEOUT or time.monotonic() - t0 >= self.timeout_s:
                    out.append(CAUSE_TIMEOUT)
                else:
                    out.append(CAUSE_ERROR)
            elif got != nbytes:
                out.append(CAUSE_VERIFY_FAILED)
            else:
                out.append(self._verify(key, entry, start, head, nbytes))
        return out

    def _verify(self, key: str, entry: EntryRef, start: int, head: int, nbytes: int) -> str:
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.entry_format import (
            decode_and_verify,
        )

        value = self.arena.view(start, nbytes).numpy()
        result = decode_and_verify(value, list(entry.token_ids), entry.virtual_start,
                                   nbytes - head)
        if not result.ok:
            logger.warning("chunk store: entry %s failed verification (%s: %s)", key,
                           result.cause, result.detail)
            return CAUSE_VERIFY_FAILED
        if bytes(value[nbytes - KEY_TAG_BYTES:]) != key_tag(key):
            logger.warning("chunk store: entry %s carries another key's tag (a value "
                           "written under another key)", key)
            return CAUSE_VERIFY_FAILED
        return FETCH_OK

    def _finish_reads(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.entry_format import (
            header_nbytes,
        )

        now = time.monotonic()
        for fetch_id, read in list(self._reads.items()):
            if not read.future.done():
                if now - read.started > 2 * self.timeout_s + 1:
                    del self._reads[fetch_id]
                    self._abandoned.append(read)
                    self._outcomes[fetch_id] = CAUSE_TIMEOUT
                    logger.warning("chunk store: read of %s timed out; computing it", fetch_id)
                continue
            del self._reads[fetch_id]
            try:
                outcome = read.future.result()[read.index]
            except Exception as e:  # noqa: BLE001 - any failure is a miss
                logger.warning("chunk store: read of %s failed: %s", fetch_id, e)
                outcome = CAUSE_ERROR
            if outcome == FETCH_OK:
                entry = read.fetch.entry
                num_rows = len(entry.token_ids) - entry.virtual_start
                head = header_nbytes(len(entry.token_ids))
                rows = self._rows(read.fetch.pool_block_ids, num_rows, self.tensors[0].device)
                for t, src in zip(self.tensors, self._payload_views(read.start + head, num_rows)):
                    t.index_copy_(0, rows, src.to(t.device))
                self._count("store_gets")
            else:
                logger.info("chunk store: %s not served from the store (%s); computing it",
                            fetch_id, outcome)
            self.arena.free(read.start)
            self._outcomes[fetch_id] = outcome
