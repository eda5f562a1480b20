# SPDX-License-Identifier: Apache-2.0
"""A LoRA adapter's identity in chunk keys: its name and a digest of its files.

NOTE: a name alone is not an identity. `/v1/load_lora_adapter` may load other
weights under a name used before (a rolling update), and two replicas may
hold different adapters under one name; KV computed with one must never be
served for the other, in the pool or from the fleet's store. The digest
covers every file of the adapter's directory (config and weights), so the
same adapter at different paths on two replicas shares entries, and another
adapter under the same name does not.

The digest is taken once per (path, the files' names, sizes, mtimes): a
request pays a directory listing, not a read of the weights. An adapter whose
files cannot be read here (e.g. a path only a worker resolves) gets an
identity unique to this process: it is never shared, so never wrong.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from pathlib import Path
from typing import Any

_PIECE = 1 << 20
_PROCESS = uuid.uuid4().hex
_lock = threading.Lock()
_digests: dict[tuple, str] = {}


def lora_identity(lora_request: Any | None) -> str:
    """"" without an adapter, else "<name>@<digest of its files>"."""
    if lora_request is None:
        return ""
    name = str(lora_request.lora_name)
    path = getattr(lora_request, "lora_path", None) or ""
    digest = adapter_digest(path)
    if digest is None:
        return f"{name}@local:{_PROCESS}:{path}"
    return f"{name}@{digest}"


def adapter_digest(path: str) -> str | None:
    """BLAKE2b-128 over the relative names and bytes of every file under
    `path` (a directory or one file); None if it cannot be read."""
    if not path:
        return None
    try:
        files = _listing(Path(path))
    except OSError:
        return None
    if not files:
        return None
    stamp = (path, tuple(files))
    with _lock:
        known = _digests.get(stamp)
    if known is not None:
        return known
    h = hashlib.blake2b(digest_size=16, person=b"chunk-lora-v1")
    root = Path(path)
    try:
        for rel, size, _ in files:
            h.update(f"{rel}\0{size}\0".encode())
            with open(root / rel if rel else root, "rb") as f:
                while piece := f.read(_PIECE):
                    h.update(piece)
    except OSError:
        return None
    digest = h.hexdigest()
    with _lock:
        _digests[stamp] = digest
    return digest


def _listing(root: Path) -> list[tuple[str, int, int]]:
    """(relative name, size, mtime_ns) of every file, sorted."""
    if root.is_file():
        st = root.stat()
        return [("", st.st_size, st.st_mtime_ns)]
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            st = p.stat()
            out.append((str(p.relative_to(root)), st.st_size, st.st_mtime_ns))
    return sorted(out)
