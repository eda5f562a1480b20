# SPDX-License-Identifier: Apache-2.0
"""EntrySeal: the tag at the end of every entry's payload, binding it to its key.

Two modes:

- unauthenticated (default): xxh3-128 of the key. It catches a value copied
  under another key (another model, weights version, rank, tenant) by mistake,
  and the header's checksum covers it. It does NOT stop anyone who can write to
  the store: such a writer can store any KV under any key and make it verify.
- authenticated (`--chunk-store ...&key_file=PATH`): keyed BLAKE3 (a vLLM
  dependency) with the fleet's secret over the key and the whole payload
  before the tag. Without the secret no value verifies under any key.

Either way the header (token ids in clear, virtual start, checksum) is
readable by anyone who can read the store.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

TAG_BYTES = 16
# The secret is hashed to BLAKE3's 32-byte key (any length of secret works).
_KEY_CONTEXT = "chunkcache 2026-11 store entry MAC v1"
_MIN_SECRET_BYTES = 16


class EntrySeal:
    def __init__(self, secret: bytes | None = None):
        self._key: bytes | None = None
        if secret is not None:
            import blake3

            if len(secret) < _MIN_SECRET_BYTES:
                raise ValueError(f"the chunk store's secret must have at least "
                                 f"{_MIN_SECRET_BYTES} bytes, got {len(secret)}")
            self._key = blake3.blake3(secret, derive_key_context=_KEY_CONTEXT).digest()

    @classmethod
    def from_key_file(cls, key_file: str | None) -> EntrySeal:
        if key_file is None:
            return cls()
        try:
            secret = Path(key_file).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"--chunk-store key_file {key_file!r} cannot be read: {e}") from e
        return cls(secret)

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def tag(self, key: str, body) -> bytes:
        """The tag of payload `body` (everything before the tag) under `key`."""
        return self.tag_of_parts(key, [body])

    def tag_of_parts(self, key: str, parts) -> bytes:
        """`tag` of the payload made of `parts` in order (a read that landed
        in pool rows: the payload is never one buffer)."""
        if self._key is None:
            return xxhash.xxh3_128(key.encode()).digest()
        import blake3

        mac = blake3.blake3(key=self._key)
        mac.update(key.encode())
        mac.update(b"\0")
        for part in parts:
            mac.update(memoryview(part).cast("B"))
        return mac.digest(length=TAG_BYTES)
