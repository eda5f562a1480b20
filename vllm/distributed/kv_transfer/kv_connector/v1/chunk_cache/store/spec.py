# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""StoreSpec: where the chunk store is and how to connect (`--chunk-store`).

Two spellings of the same thing:

    mooncake://127.0.0.1:50051?segment=0&buffer=64MB&timeout=5
    {"master": "127.0.0.1:50051", "segment": 0, "buffer": "64MB", "timeout": 5}

The keys are StoreSpec's fields without their unit (`timeout` for timeout_s,
`arena` for arena_bytes, ...). Sizes are bytes or a number with KB/MB/GB
(binary, as Mooncake reads them: 1 MB = 2**20 bytes).

No torch or Mooncake imports: vllm/config/chunk_cache.py validates the flag through
this module at config time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlsplit

import regex as re

SCHEME = "mooncake"
PROTOCOLS = ("tcp", "rdma", "ascend")
_UNITS = {"": 1, "B": 1} | {
    unit + tail: 1 << shift
    for unit, shift in (("K", 10), ("M", 20), ("G", 30))
    for tail in ("", "B", "IB")
}
_SIZE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")
_SECONDS = ("timeout", "lookup_timeout", "read_timeout", "held_limit")
_STRINGS = ("protocol", "metadata_server", "local_hostname", "key_file", "local_client")
_KEYS = ("segment", "buffer", "arena", "direct_reads", *_SECONDS, *_STRINGS)
# The node's client by default: a crash in Mooncake's transfer code is then a
# miss here, not a dead engine. 50052 is `mooncake_client --port`'s default.
DEFAULT_LOCAL_CLIENT = "127.0.0.1:50052"
IN_PROCESS = "none"


@dataclass(frozen=True)
class StoreSpec:
    master_address: str
    """The Mooncake master's RPC address, "host:port"."""

    segment_bytes: int = 0
    """Bytes of this process's memory lent to the store (0: the node's
    `mooncake_client` holds the entries, which then outlive this process)."""

    buffer_bytes: int = 16 << 20
    """The client's local transfer buffer (Mooncake's local_buffer_size)."""

    protocol: str = "tcp"
    """"tcp", "rdma" or "ascend"."""

    metadata_server: str = "P2PHANDSHAKE"
    """Mooncake's metadata service; P2PHANDSHAKE needs none."""

    local_hostname: str = "127.0.0.1"
    """The address this process's transfer engine listens on and announces."""

    timeout_s: float = 5.0
    """Deadline of one store call: a call not answered by then is a miss."""

    lookup_timeout_s: float = 0.05
    """How long a request waits for the store's existence answer before its
    missing documents are computed."""

    read_timeout_s: float = 0.5
    """The least time a read is given before the document is computed instead
    (a large entry gets more, at the bandwidth this replica measured)."""

    held_limit_s: float = 300.0
    """How long pool rows lent to a read given up on may stay lent (its call
    has not returned); past it they are written off: out of the pool for good."""

    arena_bytes: int | None = None
    """Host memory for reads (and as much for writes); None: two entries of
    --max-chunk-tokens, at least 256 MB."""

    key_file: str | None = None
    """A file holding the fleet's secret: entries then carry a keyed BLAKE3 MAC,
    and one without a valid MAC is a miss."""

    local_client: str | None = None
    """"host:port" of the node's mooncake_client: this process then runs
    Mooncake's dummy client only and that client makes every transfer. None
    ("none" in the flag): the client runs in this process. The flag's default
    is DEFAULT_LOCAL_CLIENT unless `segment` lends memory."""

    direct_reads: bool = False
    """With the client in this process and a host pool, reads land straight in
    the pool rows: one host copy fewer, but a get that fails in transfer then
    holds its pool rows until `held_limit` writes them off (by default it holds
    an arena span: docs/design/chunk-store.md)."""

    def __post_init__(self) -> None:
        _check_address(self.master_address)
        if self.segment_bytes < 0:
            raise ValueError(f"segment must be >= 0 bytes, got {self.segment_bytes}")
        if self.buffer_bytes <= 0:
            raise ValueError(f"buffer must be > 0 bytes, got {self.buffer_bytes}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"
            )
        if not self.metadata_server:
            raise ValueError("metadata_server must not be empty")
        if not self.local_hostname or any(c in self.local_hostname for c in " /?#"):
            raise ValueError(f"bad local_hostname {self.local_hostname!r}")
        for name in _SECONDS:
            value = getattr(self, f"{name}_s")
            if not 0 < value <= 3600:
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {value}")
        if self.arena_bytes is not None and self.arena_bytes < (1 << 20):
            raise ValueError(
                f"arena must be at least 1MB, got {self.arena_bytes} bytes"
            )
        if self.key_file is not None and not self.key_file:
            raise ValueError("key_file must name a file")
        if self.local_client is not None:
            _check_address(self.local_client, "local_client")
            if self.segment_bytes:
                raise ValueError(
                    "segment must be 0 with local_client: the node's "
                    "mooncake_client lends the memory"
                )

    @property
    def master_port(self) -> int:
        return int(self.master_address.rpartition(":")[2])

    def to_url(self) -> str:
        """The URL form (parse_store_spec(spec.to_url()) == spec)."""
        url = (
            f"{SCHEME}://{self.master_address}?segment={self.segment_bytes}"
            f"&buffer={self.buffer_bytes}"
            + "".join(f"&{n}={getattr(self, f'{n}_s'):g}" for n in _SECONDS)
            + f"&protocol={self.protocol}&metadata_server={self.metadata_server}"
            f"&local_hostname={self.local_hostname}"
        )
        if self.arena_bytes is not None:
            url += f"&arena={self.arena_bytes}"
        if self.key_file is not None:
            url += f"&key_file={quote(self.key_file, safe='/')}"
        if self.direct_reads:
            url += "&direct_reads=1"
        url += f"&local_client={self.local_client or IN_PROCESS}"
        return url


def parse_store_spec(text: str) -> StoreSpec:
    """A StoreSpec from the URL or JSON form; ValueError saying what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            "empty store spec: expected e.g. "
            f"'{SCHEME}://127.0.0.1:50051?segment=0&buffer=16MB&timeout=5' "
            'or \'{"master": "127.0.0.1:50051"}\''
        )
    text = text.strip()
    if text == "local":
        raise ValueError(
            "expected the Mooncake master's address, e.g. "
            f"'{SCHEME}://127.0.0.1:50051' (vLLM starts no master)"
        )
    if text.startswith("{"):
        return _from_json(text)
    return _from_url(text)


def _from_url(text: str) -> StoreSpec:
    url = urlsplit(text)
    if url.scheme != SCHEME:
        raise ValueError(
            f"store spec must start with '{SCHEME}://' (or be a JSON object), "
            f"got {text!r}"
        )
    if url.path not in ("", "/") or url.fragment or url.username or url.password:
        raise ValueError(f"store spec URL has parts it cannot use: {text!r}")
    try:
        pairs = parse_qsl(
            url.query, keep_blank_values=True, strict_parsing=bool(url.query)
        )
    except ValueError as e:
        raise ValueError(f"bad query in store spec {text!r}: {e}") from None
    fields: dict[str, str] = {}
    for key, value in pairs:
        if key in fields:
            raise ValueError(f"store spec gives {key!r} twice")
        fields[key] = value
    return _build(url.netloc, fields)


def _from_json(text: str) -> StoreSpec:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"store spec is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("store spec JSON must be an object")
    if "master" not in obj:
        raise ValueError('store spec JSON needs "master": "host:port"')
    master = obj.pop("master")
    if not isinstance(master, str):
        raise ValueError(f'"master" must be a string "host:port", got {master!r}')
    return _build(master, obj)


def _build(master: str, fields: dict) -> StoreSpec:
    unknown = sorted(set(fields) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"unknown store spec key(s) {', '.join(map(repr, unknown))}; "
            f"known: master, {', '.join(_KEYS)}"
        )
    kwargs: dict = {"master_address": master}
    if "segment" in fields:
        kwargs["segment_bytes"] = _size("segment", fields["segment"])
    if "buffer" in fields:
        kwargs["buffer_bytes"] = _size("buffer", fields["buffer"])
    for key in _SECONDS:
        if key in fields:
            kwargs[f"{key}_s"] = _seconds(key, fields[key])
    if "arena" in fields:
        kwargs["arena_bytes"] = _size("arena", fields["arena"])
    if "direct_reads" in fields:
        kwargs["direct_reads"] = _flag("direct_reads", fields["direct_reads"])
    for key in _STRINGS:
        if key in fields:
            if key == "local_client" and fields[key] in (None, IN_PROCESS):
                kwargs[key] = None  # the client in this process
                continue
            if not isinstance(fields[key], str):
                raise ValueError(f"{key} must be a string, got {fields[key]!r}")
            kwargs[key] = fields[key]
    if "local_client" not in fields and not kwargs.get("segment_bytes"):
        # A process that lends memory runs the client itself.
        kwargs["local_client"] = DEFAULT_LOCAL_CLIENT
    return StoreSpec(**kwargs)


def _size(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size, got {value!r}")
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(
            f"{name} must be a size in bytes or with KB/MB/GB, e.g. 64MB, got {value!r}"
        )
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _flag(name: str, value) -> bool:
    text = str(value).strip().lower()  # JSON's true/false too
    if text not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return text in ("1", "true", "yes", "on")


def _seconds(name: str, value) -> float:
    try:
        if not isinstance(value, bool):
            return float(value)
    except (TypeError, ValueError):
        pass
    raise ValueError(f"{name} must be a number of seconds, got {value!r}")


def _check_address(address: str, what: str = "master address") -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be 'host:port', got {address!r}")
    if any(c in host for c in " /?#@"):
        raise ValueError(f"bad host in {what} {address!r}")
