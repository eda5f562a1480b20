# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler's side of the fleet-wide chunk store.

`StoreClient` answers the manager's `StoreProbe.lookup` from existence queries
run on its own thread (one `batch_exists` per step), tracks the fetches it
hands to the workers until every rank reported (and pool rows a failed fetch's
calls still hold), and queues children's entries for the workers to write.
Nothing here blocks the scheduler: a query not answered yet is PENDING, a store
that cannot be reached answers MISS. See docs/design/store-path.md.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.core.chunk_hash_index import compute_chunk_hash
from vllm.v1.core.chunk_store_probe import (
    FetchFailure,
    FetchSpec,
    ReportResult,
    StoreAnswer,
    StoreLookup,
)
from vllm.v1.core.chunk_structures import ChunkNamespace

from .base import Presence
from .connection import SharedStore
from .lora_loads import LOADED_SEP, adapter_of
from .messages import (
    CAUSE_ERROR,
    FETCH_OK,
    MISS_CAUSES,
    EntryFetch,
    EntryPut,
    EntryRef,
    FetchOutcome,
    RankIdentity,
    StoreReport,
    StoreStep,
    store_key_for,
)
from .read_cost import ReadCost

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# How long an existence answer is reused (a parent whose other keys were
# still being asked must not ask again forever).
ANSWER_TTL_S = 5.0
# A new epoch's identities come with the workers' next step; if they do not
# (a broken worker), lookups stop waiting for them after this long.
IDENTITY_WAIT_S = 30.0


def store_content_hash(
    segment_ids: list[int], context_ids: list[int], cache_salt: str | None, lora: str
) -> int:
    """The content part of a store key: the tokens and the tenant only (the
    rank's identity names the model and weights, not the pool's namespace)."""
    namespace = ChunkNamespace(
        model="", kv_dtype="", tokenizer="", lora_name=lora, cache_salt=cache_salt
    )
    digest = compute_chunk_hash(segment_ids, context_ids, namespace.digest())
    return int.from_bytes(digest, "little")


@dataclass
class _Answer:
    lookup: StoreLookup
    at: float
    cache_salt: str | None
    lora: str


@dataclass
class _Fetch:
    entry: EntryRef
    started: float
    outcomes: list[str] = dataclasses.field(default_factory=list)


@dataclass
class StoreCounters:
    """Cumulative; `take` gives the increments since its last call."""

    store_hits: int = 0
    store_misses_absent: int = 0
    store_misses_verify_failed: int = 0
    store_misses_error: int = 0
    store_misses_timeout: int = 0
    # Also in store_misses_timeout.
    store_lookup_timeouts: int = 0
    # Hits computed as the read was expected to be slower (read_cost.py), and
    # the expected times of every hit decided with both estimates.
    store_reads_skipped_slower: int = 0
    store_expected_read_seconds: float = 0.0
    store_expected_compute_seconds: float = 0.0
    store_fetch_seconds: float = 0.0
    store_puts_queued: int = 0
    store_reads_written_off: int = 0

    def take(self) -> dict[str, float]:
        now = dataclasses.asdict(self)
        last = getattr(self, "_reported", {})
        self._reported = now
        return {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}


class StoreClient:
    """The manager's `StoreProbe` (chunk_store_probe.py)."""

    def __init__(self, vllm_config: VllmConfig):
        spec_text = vllm_config.chunk_cache_config.chunk_store
        assert spec_text is not None
        parallel = vllm_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        self.world_size = self.tp_size * self.pp_size
        self._shared = SharedStore.of(spec_text)
        self.lookup_timeout_s = self._shared.spec.lookup_timeout_s
        self.read_cost = ReadCost()
        # Connect now, off the step: the first request need not count a miss.
        self._shared.start_connecting()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="chunk-store-query")
        self._identities: dict[int, dict[tuple[int, int], RankIdentity]] = {}
        self._epoch_seen: dict[int, float] = {}
        # lookup id -> answer; when each unanswered lookup was first asked;
        # lookups asked this step; the query in flight.
        self._answers: dict[tuple, _Answer] = {}
        self._first_asked: dict[tuple, float] = {}
        self._asked: dict[tuple, tuple[list[str], str | None, str]] = {}
        self._query: tuple[dict, Future] | None = None
        self._fetches: dict[str, _Fetch] = {}
        # Fetch id -> ranks that lent its pool rows minus those that returned
        # them, while undecided or failed with rows held.
        self._lent: dict[str, int] = {}
        # Past this, the manager writes off a failed fetch's held rows.
        self.held_limit_s = self._shared.spec.held_limit_s
        # LoRA int id -> digest of the weights every rank reported loading for
        # it; an id whose ranks disagree is absent (never shared).
        self._lora_digests: dict[int, str] = {}
        self._step = StoreStep(epoch=0)
        self._puts: list[tuple[int, EntryPut]] = []
        self.counters = StoreCounters()
        self._store_down = False

    # ------------------------------------------------------------ lookups

    def lookup(
        self, segment_ids: list[int], context_ids: list[int], namespace: ChunkNamespace
    ) -> StoreLookup:
        self._collect()
        epoch = namespace.weights_epoch
        identities = self._ranks(epoch)
        if identities is None:
            return StoreLookup(StoreAnswer.PENDING)
        if not identities:
            return StoreLookup(StoreAnswer.MISS)
        lora = self.store_lora(namespace.lora_name)
        if lora is None:
            return StoreLookup(StoreAnswer.MISS)  # no rank said what it loaded
        content = store_content_hash(
            segment_ids, context_ids, namespace.cache_salt, lora
        )
        lookup_id = (epoch, content)
        now = time.monotonic()
        answer = self._answers.get(lookup_id)
        if answer is not None and now - answer.at < ANSWER_TTL_S:
            if answer.lookup.answer is StoreAnswer.HIT:
                return self._worth_reading(
                    answer.lookup, len(segment_ids), len(segment_ids) + len(context_ids)
                )
            return answer.lookup
        first = self._first_asked.setdefault(lookup_id, now)
        if now - first >= self.lookup_timeout_s:
            # No answer in time: compute it (a stopped store costs this much).
            del self._first_asked[lookup_id]
            self.counters.store_misses_timeout += 1
            self.counters.store_lookup_timeouts += 1
            miss = StoreLookup(StoreAnswer.MISS)
            self._answers[lookup_id] = _Answer(miss, now, namespace.cache_salt, lora)
            return miss
        if lookup_id not in self._asked:
            entry = EntryRef(content, (), 0, namespace.cache_salt, lora)
            keys = [
                store_key_for(i, self.tp_size, self.pp_size, entry) for i in identities
            ]
            self._asked[lookup_id] = (keys, namespace.cache_salt, lora)
        return StoreLookup(StoreAnswer.PENDING)

    def _worth_reading(
        self, hit: StoreLookup, num_rows: int, num_tokens: int
    ) -> StoreLookup:
        decision = self.read_cost.decide(num_rows, num_tokens)
        read_s, compute_s = decision.expected_read_s, decision.expected_compute_s
        if read_s is not None and compute_s is not None:
            self.counters.store_expected_read_seconds += read_s
            self.counters.store_expected_compute_seconds += compute_s
        if decision.read:
            return hit
        self.counters.store_reads_skipped_slower += 1
        return StoreLookup(StoreAnswer.MISS)

    def note_child_computed(self, num_tokens: int, seconds: float) -> None:
        """A child's prefill, first step to finish (ReadCost's compute side)."""
        self.read_cost.note_compute(num_tokens, seconds)

    def _ranks(self, epoch: int) -> list[RankIdentity] | None:
        """Every rank's identity in `epoch`; None while the workers have not
        reported it yet, [] if they never did (the store is then skipped)."""
        ranks = self._identities.get(epoch, {})
        if len(ranks) == self.world_size:
            # A complete newer epoch retires the older ones' records.
            self._identities = {e: r for e, r in self._identities.items() if e >= epoch}
            self._epoch_seen = {e: t for e, t in self._epoch_seen.items() if e >= epoch}
            return [ranks[k] for k in sorted(ranks)]
        first = self._epoch_seen.setdefault(epoch, time.monotonic())
        if time.monotonic() - first > IDENTITY_WAIT_S:
            return []
        return None

    def _collect(self) -> None:
        """Take the answers of a finished query (scheduler thread)."""
        if self._query is None or not self._query[1].done():
            return
        asked, future = self._query
        self._query = None
        now = time.monotonic()
        try:
            presence = future.result()
        except Exception as e:  # a failed query is a miss
            logger.warning("chunk store: existence query failed: %s", e)
            presence = None
        self._note_health(presence is not None and Presence.ERROR not in presence)
        offset = 0
        for lookup_id, (keys, salt, lora) in asked.items():
            found = None if presence is None else presence[offset : offset + len(keys)]
            offset += len(keys)
            if found is not None and all(p == Presence.PRESENT for p in found):
                result = StoreLookup(StoreAnswer.HIT, lookup_id[1])
            else:
                if found is None or any(p == Presence.ERROR for p in found):
                    self.counters.store_misses_error += 1
                else:
                    self.counters.store_misses_absent += 1
                result = StoreLookup(StoreAnswer.MISS)
            self._first_asked.pop(lookup_id, None)
            if lookup_id in self._answers:
                continue  # answered MISS at its deadline: that answer stands
            self._answers[lookup_id] = _Answer(result, now, salt, lora)

    def _note_health(self, ok: bool) -> None:
        """One log line when the store stops answering, one when it is back."""
        if not ok and not self._store_down:
            logger.warning(
                "chunk store %s is not answering: documents missing from the "
                "pool are computed here (served exactly, as misses) until it "
                "answers again",
                self._shared.spec_text,
            )
        elif ok and self._store_down:
            logger.info("chunk store %s answers again", self._shared.spec_text)
        self._store_down = not ok

    def flush(self) -> None:
        """Send the keys asked in this step as one query (end of a step)."""
        self._collect()
        now = time.monotonic()
        ttl = ANSWER_TTL_S
        self._answers = {k: a for k, a in self._answers.items() if now - a.at < ttl}
        self._first_asked = {
            k: t for k, t in self._first_asked.items() if now - t < ttl
        }
        if self._query is not None or not self._asked:
            return
        asked, self._asked = self._asked, {}
        keys = [k for ks, _, _ in asked.values() for k in ks]
        self._query = (asked, self._thread.submit(self._exists, keys))

    def _exists(self, keys: list[str]) -> list[Presence] | None:
        store = self._shared.get()
        if store is None:
            return None
        return store.batch_exists(keys)

    # ------------------------------------------------------------ fetches

    def start_fetch(self, spec: FetchSpec, pool_block_ids: list[int]) -> None:
        answer = self._answers.get((spec.epoch, spec.content_hash))
        salt, lora = (answer.cache_salt, answer.lora) if answer else (None, "")
        entry = EntryRef(
            spec.content_hash, tuple(spec.token_ids), spec.store_start, salt, lora
        )
        self._fetches[spec.request_id] = _Fetch(entry, time.monotonic())
        self._step.fetches.append(
            EntryFetch(spec.request_id, entry, tuple(int(b) for b in pool_block_ids))
        )

    def store_lora(self, identity: str) -> str | None:
        """The store's name for a pool's LoRA identity "<name>#<int id>":
        "<name>@<digest of the weights loaded>", "" without an adapter, None
        while no rank has reported loading it (or ranks disagree)."""
        adapter = adapter_of(identity)
        if adapter is None:
            return ""
        digest = self._lora_digests.get(adapter[1])
        return None if digest is None else f"{adapter[0]}{LOADED_SEP}{digest}"

    def queue_put(
        self,
        token_ids: list[int],
        store_start: int,
        cache_salt: str | None,
        lora: str,
        pool_block_ids: list[int],
        epoch: int,
    ) -> None:
        """`lora`: the pool's identity of the child's adapter (store_lora)."""
        name = self.store_lora(lora)
        if name is None:
            return  # no rank vouched for the adapter's weights
        content = store_content_hash(
            token_ids[store_start:], token_ids[:store_start], cache_salt, name
        )
        entry = EntryRef(content, tuple(token_ids), store_start, cache_salt, name)
        self._puts.append(
            (epoch, EntryPut(entry, tuple(int(b) for b in pool_block_ids)))
        )
        self.counters.store_puts_queued += 1

    def take_step(self, epoch: int) -> StoreStep:
        self.flush()
        step, self._step = self._step, StoreStep(epoch=epoch)
        step.epoch = epoch
        # An entry computed before a reset is never written (the workers would
        # key it with the new epoch's weights version).
        step.puts = [put for put_epoch, put in self._puts if put_epoch == epoch]
        self._puts = []
        return step

    def on_report(self, report: StoreReport) -> ReportResult:
        """Fold in the workers' report: the fetches every rank completed, the
        fetches some rank failed (with the first failure's cause, and whether
        a rank's call still holds the rows), and the held rows returned."""
        for identity in report.identities:
            by_rank = self._identities.setdefault(identity.epoch, {})
            by_rank[(identity.pp_rank, identity.tp_rank)] = identity
            self.read_cost.note_row_bytes(identity.row_bytes)
        if report.read_bytes_per_s:
            self.read_cost.note_read_bandwidth(report.read_bytes_per_s)
        for lora_id, digests in report.lora_loads.items():
            if len(set(digests)) == 1:
                self._lora_digests[lora_id] = digests[0]
            else:
                self._lora_digests.pop(lora_id, None)
        # Lent before returned (a rank may report both in one step), both
        # before the outcomes (a rank's rows_lent comes with its outcome).
        for fetch_id, ranks in report.rows_lent.items():
            if fetch_id not in self._fetches:
                logger.warning(
                    "chunk store: rows lent for unknown fetch %s ignored", fetch_id
                )
                continue
            self._lent[fetch_id] = self._lent.get(fetch_id, 0) + ranks
        returned = []
        for fetch_id, ranks in report.rows_returned.items():
            if fetch_id not in self._lent:
                continue  # unknown, or nothing lent: nothing held for it
            self._lent[fetch_id] -= ranks
            if self._lent[fetch_id] <= 0 and fetch_id not in self._fetches:
                # Failed with rows held in an earlier report: now free.
                del self._lent[fetch_id]
                returned.append(fetch_id)
        done, failed = [], []
        for fetch_id, results in report.outcomes.items():
            fetch = self._fetches.get(fetch_id)
            if fetch is None:
                continue
            fetch.outcomes.extend(results)
            if len(fetch.outcomes) < self.world_size:
                continue
            del self._fetches[fetch_id]
            self.counters.store_fetch_seconds += time.monotonic() - fetch.started
            # Held only while some rank holds the rows.
            held = self._lent.get(fetch_id, 0) > 0
            if not held:
                self._lent.pop(fetch_id, None)
            causes = [c for c in fetch.outcomes if c != FETCH_OK]
            if held and not causes:
                causes = [CAUSE_ERROR]  # rows still lent may change: never served
            if not causes:
                self.counters.store_hits += 1
                done.append(fetch_id)
                continue
            cause = causes[0] if causes[0] in MISS_CAUSES else CAUSE_ERROR
            name = f"store_misses_{FetchOutcome(cause).value}"
            setattr(self.counters, name, getattr(self.counters, name) + 1)
            failed.append(FetchFailure(fetch_id, FetchOutcome(cause), rows_held=held))
        return ReportResult(tuple(done), tuple(failed), tuple(returned))

    def write_off(self, fetch_id: str) -> None:
        """The manager wrote off a failed fetch's held rows (held_limit): a
        rank's late return is then ignored."""
        self._lent.pop(fetch_id, None)
        self.counters.store_reads_written_off += 1
        logger.warning(
            "chunk store: %s's store call has held its pool rows for %g s "
            "(held_limit); they are written off: out of the pool for good, "
            "never read or handed out again",
            fetch_id,
            self.held_limit_s,
        )

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
