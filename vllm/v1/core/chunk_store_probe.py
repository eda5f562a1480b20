# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the manager asks the fleet-wide chunk store at admission, an
engine-free protocol. The connector's `StoreClient` (store/lookups.py)
answers from queries on its own thread and never blocks: a query in flight
answers PENDING and the parent waits a step (docs/design/store-path.md)."""

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from vllm.v1.core.chunk_structures import ChunkHash, ChunkNamespace

# Request ids of store fetches (never vLLM requests; unique among children).
FETCH_ID_PREFIX = "chunkstore-fetch-"


class StoreAnswer(str, Enum):
    # Every rank's entry exists in the store: fetch instead of computing.
    HIT = "hit"
    # Absent, or the store could not be asked (counted by cause): compute.
    MISS = "miss"
    # The query has not answered yet: ask again next step.
    PENDING = "pending"


@dataclass(frozen=True)
class StoreLookup:
    answer: StoreAnswer
    # The entry's content hash in the store's key (keys.store_key), for HIT.
    content_hash: int = 0


@dataclass(frozen=True)
class FetchSpec:
    """A store hit the manager allocated a pool entry for: the workers read
    it into the entry's rows (pinned like a child's until it ends)."""

    request_id: str
    chunk_hash: ChunkHash
    # Context + segment ids; rows [store_start, len(token_ids)) are the entry's.
    token_ids: list[int]
    store_start: int
    content_hash: int
    # The manager's epoch when the fetch started.
    epoch: int
    # The pool blocks the workers read it into, in row order.
    pool_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class FetchFailure:
    """A fetch some rank failed (`ReportResult.failed`)."""

    fetch_id: str
    # The first failure's cause (a miss cause; anything else is an error).
    cause: str
    # Some rank's store call still holds the fetch's pool rows: nobody may
    # get them until `ReportResult.rows_returned` names the fetch.
    rows_held: bool = False


@dataclass(frozen=True)
class ReportResult:
    """What `StoreClient.on_report` decided from one (combined) report."""

    # Fetches every rank completed.
    done: tuple[str, ...] = ()
    # Fetches some rank failed.
    failed: tuple[FetchFailure, ...] = ()
    # Failed fetches reported with rows_held earlier whose rows every rank
    # has returned since (rows never returned: `write_off_held`).
    rows_returned: tuple[str, ...] = ()


class StoreProbe(Protocol):
    def lookup(
        self,
        segment_ids: list[int],
        context_ids: list[int],
        namespace: ChunkNamespace,
    ) -> StoreLookup:
        """Whether a segment missing from the pool is in the store (its
        namespace carries the manager's epoch)."""
        ...
