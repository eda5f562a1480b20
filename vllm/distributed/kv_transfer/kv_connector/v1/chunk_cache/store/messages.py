# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the store path sends between the scheduler and the workers.

Down (`ChunkCacheMetadata.store`): the entries to read into pool rows and the
children's entries to write, with the scheduler's epoch. Up (vLLM's worker
metadata, combined by `StoreReport.aggregate`): each rank's outcome per fetch
and its identity (the part of the store key only the worker knows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from .keys import StoreNamespace, store_key


class FetchOutcome(str, Enum):
    """OK (read, verified, in the pool rows) or a miss cause; a str, so it
    crosses processes as itself."""

    OK = "ok"
    ABSENT = "absent"
    VERIFY_FAILED = "verify_failed"
    ERROR = "error"
    TIMEOUT = "timeout"


FETCH_OK = FetchOutcome.OK
CAUSE_ABSENT = FetchOutcome.ABSENT
CAUSE_VERIFY_FAILED = FetchOutcome.VERIFY_FAILED
CAUSE_ERROR = FetchOutcome.ERROR
CAUSE_TIMEOUT = FetchOutcome.TIMEOUT
MISS_CAUSES = (CAUSE_ABSENT, CAUSE_VERIFY_FAILED, CAUSE_ERROR, CAUSE_TIMEOUT)


@dataclass(frozen=True)
class EntryRef:
    """One entry as the store knows it (each rank keys it with its identity)."""

    content_hash: int
    # Context + segment, and the first stored row's position (len(context)).
    token_ids: tuple[int, ...]
    virtual_start: int
    cache_salt: str | None
    lora: str


@dataclass(frozen=True)
class EntryFetch:
    fetch_id: str
    entry: EntryRef
    pool_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class EntryPut:
    entry: EntryRef
    pool_block_ids: tuple[int, ...]


@dataclass
class StoreStep:
    """One step's store work for the workers."""

    # Cache resets so far: a new one has the workers fingerprint the weights.
    epoch: int
    fetches: list[EntryFetch] = field(default_factory=list)
    puts: list[EntryPut] = field(default_factory=list)


@dataclass(frozen=True)
class RankIdentity:
    """The store-key fields one worker rank owns (keys.StoreNamespace)."""

    epoch: int
    tp_rank: int
    pp_rank: int
    model: str
    weights_version: str
    kv_dtype: str
    kv_layout: str
    rope: str
    compute: str
    # Bytes of one stored row on this rank (not in the key: the read cost).
    row_bytes: int = 0


@dataclass
class StoreReport(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step (combined over workers)."""

    # fetch id -> one outcome per rank that finished it this step.
    outcomes: dict[str, list[FetchOutcome]] = field(default_factory=dict)
    identities: list[RankIdentity] = field(default_factory=list)
    # The read bandwidth measured (bytes/s; 0: none yet), the slowest rank's.
    read_bytes_per_s: float = 0.0
    # Fetch id -> ranks whose given-up read into pool rows still holds them
    # (the store may still write there), and ranks whose call has returned
    # since: the scheduler hands those blocks to no one in between.
    rows_lent: dict[str, int] = field(default_factory=dict)
    rows_returned: dict[str, int] = field(default_factory=dict)
    # LoRA int id -> digest of the weights each rank loaded (lora_loads.py).
    lora_loads: dict[int, list[str]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StoreReport:
        assert isinstance(other, StoreReport)
        for fetch_id, results in other.outcomes.items():
            self.outcomes.setdefault(fetch_id, []).extend(results)
        self.identities.extend(other.identities)
        rates = [r for r in (self.read_bytes_per_s, other.read_bytes_per_s) if r > 0]
        self.read_bytes_per_s = min(rates) if rates else 0.0
        for mine, theirs in (
            (self.rows_lent, other.rows_lent),
            (self.rows_returned, other.rows_returned),
        ):
            for fetch_id, ranks in theirs.items():
                mine[fetch_id] = mine.get(fetch_id, 0) + ranks
        for lora_id, digests in other.lora_loads.items():
            self.lora_loads.setdefault(lora_id, []).extend(digests)
        return self

    def is_empty(self) -> bool:
        return (
            not self.outcomes
            and not self.identities
            and not self.read_bytes_per_s
            and not self.rows_lent
            and not self.rows_returned
            and not self.lora_loads
        )


def store_key_for(
    identity: RankIdentity, tp_size: int, pp_size: int, entry: EntryRef
) -> str:
    """The key of `entry` for one rank."""
    namespace = StoreNamespace(
        model=identity.model,
        weights_version=identity.weights_version,
        kv_dtype=identity.kv_dtype,
        kv_layout=identity.kv_layout,
        rope=identity.rope,
        compute=identity.compute,
        tp_rank=identity.tp_rank,
        tp_size=tp_size,
        pp_rank=identity.pp_rank,
        pp_size=pp_size,
        cache_salt=entry.cache_salt,
        lora=entry.lora,
    )
    return store_key(namespace, entry.content_hash)
