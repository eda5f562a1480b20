# SPDX-License-Identifier: Apache-2.0
"""The boundary between the connector's scheduler half and its workers."""

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class ChunkCacheMetadata(KVConnectorMetadata):
    """One step's work for the workers (plain lists: cheap to pickle)."""

    # Load: pool row -> paged slot, rotate K by delta.
    load_src_rows: list[int] = field(default_factory=list)
    load_dst_slots: list[int] = field(default_factory=list)
    load_deltas: list[int] = field(default_factory=list)
    # Capture: token at paged slot -> pool row.
    store_src_slots: list[int] = field(default_factory=list)
    store_dst_rows: list[int] = field(default_factory=list)
