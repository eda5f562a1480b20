# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EntrySeal: the tag at the end of every entry's payload, binding it to its key.

- unauthenticated (default): xxh3-128 of the key. It catches a value copied
  under another key by mistake; anyone who can write to the store can still
  store any KV under any key and make it verify.
- authenticated (`--chunk-store ...&key_file=PATH`): keyed BLAKE3 with the
  fleet's secret over the key, the header (entry_format.header_for_mac: the
  key binds the tokens only by a non-cryptographic hash) and the payload.

Either way the header (token ids in clear) is readable by any store reader.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import xxhash

TAG_BYTES = 16
# v2: the MAC covers the header too; a v1 tag never verifies as v2.
_KEY_CONTEXT = "chunkcache 2026-11 store entry MAC v2"
_MIN_SECRET_BYTES = 16


class EntrySeal:
    def __init__(self, secret: bytes | None = None):
        self._key: bytes | None = None
        if secret is not None:
            import blake3

            if len(secret) < _MIN_SECRET_BYTES:
                raise ValueError(
                    f"--chunk-store key_file must hold a secret of at least "
                    f"{_MIN_SECRET_BYTES} bytes, got {len(secret)}"
                )
            self._key = blake3.blake3(secret, derive_key_context=_KEY_CONTEXT).digest()

    @classmethod
    def from_key_file(cls, key_file: str | None) -> EntrySeal:
        if key_file is None:
            return cls()
        try:
            secret = Path(key_file).read_bytes().strip()
        except OSError as e:
            raise ValueError(
                f"--chunk-store key_file {key_file!r} cannot be read: {e}"
            ) from e
        return cls(secret)

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def tag_of_parts(self, key: str, mac_header: bytes, parts) -> bytes:
        """The tag of the entry of `mac_header` (entry_format.header_for_mac)
        whose payload before the tag is `parts`, in order."""
        if self._key is None:
            return xxhash.xxh3_128(key.encode()).digest()
        import blake3

        mac = blake3.blake3(key=self._key)
        mac.update(key.encode())
        mac.update(b"\0")
        mac.update(mac_header)
        for part in parts:
            mac.update(memoryview(part).cast("B"))
        return mac.digest(length=TAG_BYTES)

    def matches(self, tag, key: str, mac_header: bytes, parts) -> bool:
        """Whether `tag` is the entry's, in constant time."""
        return hmac.compare_digest(
            bytes(tag), self.tag_of_parts(key, mac_header, parts)
        )
