# SPDX-License-Identifier: Apache-2.0
"""SharedStore.use: a connection made elsewhere (tools, tests) is adopted as the
connect loop adopts its own, arenas included, whichever comes first: the
worker's want_arenas or the connection."""

from __future__ import annotations

from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.base import (
    ChunkStore,
    HostBuffer,
    Presence,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.connection import (
    SharedStore,
)

from tests.unit.distributed.store.test_store_connection import Client

# The node's client (the default): arenas are carved from its shared memory.
NODE_CLIENT_SPEC = "mooncake://127.0.0.1:47233"


class NoSharedMemory(ChunkStore):
    """A store with the seam's calls only (no `alloc_host` of its own)."""

    def register_buffer(self, buffer: HostBuffer) -> None:
        pass

    def batch_exists(self, keys: Sequence[str]) -> list[Presence]:
        return [Presence.ABSENT] * len(keys)

    def batch_get_into(self, keys, buffers, on_release=lambda: None) -> list[int]:
        on_release()
        return [-1] * len(keys)

    def batch_put_from(self, keys, buffers, on_release=lambda: None) -> list[int]:
        on_release()
        return [-4] * len(keys)

    def close(self) -> None:
        pass


def test_a_store_without_shared_memory_leaves_the_process_without_arenas():
    shared = SharedStore(NODE_CLIENT_SPEC)
    shared.use(NoSharedMemory())
    shared.want_arenas(1 << 20)  # a worker starting: never raises
    assert shared.arena("get") is None and shared.arena("put") is None


def test_adopting_a_node_client_connection_carves_the_arenas_asked_for():
    shared = SharedStore(NODE_CLIENT_SPEC)
    shared.want_arenas(1 << 20)
    client = Client({}, shared_bytes=8 << 20)
    shared.use(client)
    for kind in ("get", "put"):
        arena = shared.arena(kind)
        assert arena is not None, f"no {kind} arena after use()"
        assert client._reaches(HostBuffer(arena.ptr, arena.nbytes))
