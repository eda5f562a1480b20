# SPDX-License-Identifier: Apache-2.0
"""Chunk store read bandwidth: Mooncake Store get vs a host memcpy, one run.

    ./fork bench store [--sizes-mb 1,2,4] [--batch 8] [--repeats 20] [--local-client]
                       [--json out.json]

Starts a Mooncake master and a standalone client (lending the memory) on loopback,
writes `batch` values of each size through one MooncakeChunkStore connection and
reads them back through another (as replica B reads what replica A wrote) with
batch_get_into into a registered host buffer. Beside it, on the same bytes: a host
memcpy (numpy copyto), a plain TCP socket over loopback (the transport's floor:
what the kernel alone gives) and the xxh3-64 checksum every store read is
verified with.
Prints GB/s and the ratio store/memcpy per size; the values read are checked
byte for byte once per size.

--local-client: both connections run Mooncake's dummy client against the node's
standalone client (`local_client=`, docs/design/chunk-store.md), so on one node a
read is a copy through shared memory, not TCP; the buffers are then carved from
the dummy client's shared memory (the only memory its transfers may use).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import queue
import socket
import sys
import threading
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from forktool.mooncake_fleet import MooncakeFleet  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.base import (  # noqa: E402
    HostBuffer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.mooncake import (  # noqa: E402
    MooncakeChunkStore,
)
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.spec import (  # noqa: E402
    parse_store_spec,
)


def _best_rate(fn, nbytes: int, repeats: int) -> tuple[float, float]:
    """(median, best) bytes/s over `repeats` timed calls."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t0))
    rates.sort()
    return rates[len(rates) // 2], rates[-1]


class _TcpLoopback:
    """A plain TCP connection over 127.0.0.1 (a sender thread, recv_into here): what
    the kernel's loopback alone gives, to tell Mooncake's cost from TCP's."""

    def __init__(self, src: np.ndarray):
        self._src = memoryview(src)
        server = socket.create_server(("127.0.0.1", 0))
        self._jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send, args=(server,), daemon=True)
        self._sender.start()
        self.sock = socket.create_connection(server.getsockname())

    def _send(self, server: socket.socket) -> None:
        conn, _ = server.accept()
        server.close()
        while (n := self._jobs.get()) is not None:
            conn.sendall(self._src[:n])
        conn.close()

    def read(self, dst: np.ndarray, n: int) -> None:
        self._jobs.put(n)
        view, got = memoryview(dst), 0
        while got < n:
            got += self.sock.recv_into(view[got:n])

    def close(self) -> None:
        self._jobs.put(None)
        self.sock.close()


def _shared(store: MooncakeChunkStore, nbytes: int) -> np.ndarray:
    """`nbytes` of the dummy client's shared memory as a uint8 array."""
    ptr = store.alloc_host(nbytes)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def run(sizes_mb: list[float], batch: int, repeats: int,
        local_client: bool = False) -> list[dict]:
    biggest = int(max(sizes_mb) * (1 << 20))
    span = batch * biggest
    rows = []
    with MooncakeFleet(Path(tempfile.mkdtemp(prefix="bench-store-")),
                       segment_bytes=max(64 << 20, 2 * span * len(sizes_mb)),
                       timeout_s=30.0, buffer_bytes=16 << 20,
                       local_client=local_client) as fleet:
        spec = parse_store_spec(fleet.spec_text)
        writer, reader = (MooncakeChunkStore.connect(spec, shared_pool_bytes=span)
                          for _ in range(2))
        data = np.random.default_rng(0).integers(0, 256, span, dtype=np.uint8)
        if local_client:
            src, dst = _shared(writer, span), _shared(reader, span)
            src[:] = data
        else:
            src, dst = data, np.zeros(span, dtype=np.uint8)
        writer.register_buffer(HostBuffer(src.ctypes.data, span))
        reader.register_buffer(HostBuffer(dst.ctypes.data, span))
        tcp = _TcpLoopback(src)
        for mb in sizes_mb:
            size = int(mb * (1 << 20))
            keys = [f"bench/{size}/{i}" for i in range(batch)]
            bufs_w = [HostBuffer(src.ctypes.data + i * size, size) for i in range(batch)]
            bufs_r = [HostBuffer(dst.ctypes.data + i * size, size) for i in range(batch)]
            assert writer.batch_put_from(keys, bufs_w) == [0] * batch, "put failed"
            dst[: batch * size] = 0
            got = reader.batch_get_into(keys, bufs_r)
            assert got == [size] * batch, got
            assert np.array_equal(dst[: batch * size], src[: batch * size]), "bytes differ"
            total = batch * size

            def get():
                assert reader.batch_get_into(keys, bufs_r) == [size] * batch

            def get_one():
                assert reader.batch_get_into(keys[:1], bufs_r[:1]) == [size]

            def memcpy():
                np.copyto(dst[:total], src[:total])

            def raw_tcp():
                tcp.read(dst, total)

            def checksum():
                for i in range(batch):
                    xxhash.xxh3_64_intdigest(memoryview(dst[i * size:(i + 1) * size]))

            store_med, store_best = _best_rate(get, total, repeats)
            one_med, _ = _best_rate(get_one, size, repeats)
            copy_med, copy_best = _best_rate(memcpy, total, repeats)
            sum_med, _ = _best_rate(checksum, total, repeats)
            tcp_med, _ = _best_rate(raw_tcp, total, repeats)
            rows.append({"size_mb": mb, "batch": batch, "store_GBps": store_med / 1e9,
                         "store_best_GBps": store_best / 1e9, "store_one_GBps": one_med / 1e9,
                         "memcpy_GBps": copy_med / 1e9, "memcpy_best_GBps": copy_best / 1e9,
                         "xxh3_GBps": sum_med / 1e9, "tcp_GBps": tcp_med / 1e9,
                         "ratio": store_med / copy_med})
        tcp.close()
        writer.close()
        reader.close()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mb", default="1,2,4")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--local-client", action="store_true",
                   help="through the node's mooncake_client (shared memory on one node)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = run([float(s) for s in args.sizes_mb.split(",")], args.batch, args.repeats,
               args.local_client)
    path = "the node's client, shared memory" if args.local_client else "loopback TCP"
    print(f"# chunk store read vs host memcpy ({platform.processor() or platform.machine()}, "
          f"{path}, medians of {args.repeats})")
    print("| value | batch | store get GB/s | one-key get GB/s | memcpy GB/s | "
          "store / memcpy | plain TCP loopback GB/s | xxh3 verify GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size_mb']:g} MB | {r['batch']} | {r['store_GBps']:.2f} | "
              f"{r['store_one_GBps']:.2f} | {r['memcpy_GBps']:.2f} | {r['ratio']:.0%} | "
              f"{r['tcp_GBps']:.2f} | {r['xxh3_GBps']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
