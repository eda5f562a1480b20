"""StoreSpec / parse_store_spec: the two spellings of --chunk-store and their errors."""

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.spec import (
    StoreSpec,
    parse_store_spec,
)


def test_url_form_with_every_key():
    spec = parse_store_spec(
        "mooncake://10.0.0.7:50051?segment=64MB&buffer=32MiB&timeout=2.5&protocol=rdma"
        "&metadata_server=etcd://10.0.0.1:2379&local_hostname=10.0.0.8"
    )
    assert spec == StoreSpec(
        master_address="10.0.0.7:50051",
        segment_bytes=64 << 20,
        buffer_bytes=32 << 20,
        timeout_s=2.5,
        protocol="rdma",
        metadata_server="etcd://10.0.0.1:2379",
        local_hostname="10.0.0.8",
    )
    assert (spec.master_address, spec.master_port) == ("10.0.0.7:50051", 50051)


def test_defaults_lend_no_memory_over_tcp_on_loopback():
    spec = parse_store_spec("mooncake://127.0.0.1:50051")
    assert (
        spec.segment_bytes,
        spec.buffer_bytes,
        spec.protocol,
        spec.metadata_server,
        spec.local_hostname,
        spec.timeout_s,
    ) == (0, 16 << 20, "tcp", "P2PHANDSHAKE", "127.0.0.1", 5.0)


def test_transfers_go_through_the_nodes_client_unless_said_otherwise():
    """Issue 39, finding 7: by default Mooncake's transfer code runs in the node's
    mooncake_client (its default port), not in vLLM's process. Before: the
    default was the client in process."""
    assert (
        parse_store_spec("mooncake://127.0.0.1:50051").local_client == "127.0.0.1:50052"
    )
    assert (
        parse_store_spec('{"master": "127.0.0.1:50051"}').local_client
        == "127.0.0.1:50052"
    )
    for text in (
        "mooncake://127.0.0.1:50051?local_client=none",
        '{"master": "127.0.0.1:50051", "local_client": null}',
        '{"master": "127.0.0.1:50051", "local_client": "none"}',
        # lending memory needs the client in this process (it owns the memory)
        "mooncake://127.0.0.1:50051?segment=64MB",
    ):
        assert parse_store_spec(text).local_client is None, text
    given = parse_store_spec("mooncake://127.0.0.1:50051?local_client=10.0.0.7:6000")
    assert given.local_client == "10.0.0.7:6000"
    for spec in (
        given,
        parse_store_spec("mooncake://127.0.0.1:50051?local_client=none"),
    ):
        assert parse_store_spec(spec.to_url()) == spec
    with pytest.raises(ValueError, match="segment must be 0 with local_client"):
        parse_store_spec("mooncake://127.0.0.1:50051?segment=1MB&local_client=h:1")


def test_json_form_equals_the_url_form():
    url = parse_store_spec(
        "mooncake://127.0.0.1:7000?segment=1GB&buffer=4096&timeout=3"
    )
    js = parse_store_spec(
        '{"master": "127.0.0.1:7000", "segment": "1GB", "buffer": 4096, "timeout": 3}'
    )
    assert url == js
    assert parse_store_spec(url.to_url()) == url


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty store spec"),
        ("local", "expected the Mooncake master's address"),
        ("redis://127.0.0.1:6379", "must start with 'mooncake://'"),
        ("127.0.0.1:50051", "must start with 'mooncake://'"),
        ("mooncake://127.0.0.1", "master address must be 'host:port'"),
        ("mooncake://:50051", "master address must be 'host:port'"),
        ("mooncake://127.0.0.1:0", "master address must be 'host:port'"),
        ("mooncake://127.0.0.1:70000", "master address must be 'host:port'"),
        ("mooncake://127.0.0.1:50051/path", "parts it cannot use"),
        ("mooncake://127.0.0.1:50051?segmnt=1MB", "unknown store spec key(s) 'segmnt'"),
        ("mooncake://127.0.0.1:50051?segment=lots", "segment must be a size"),
        ("mooncake://127.0.0.1:50051?buffer=0", "buffer must be > 0"),
        ("mooncake://127.0.0.1:50051?timeout=0", "timeout must be in"),
        ("mooncake://127.0.0.1:50051?timeout=nan", "timeout must be in"),
        ("mooncake://127.0.0.1:50051?timeout=soon", "timeout must be a number"),
        ("mooncake://127.0.0.1:50051?protocol=udp", "protocol must be one of"),
        ("mooncake://127.0.0.1:50051?timeout=1&timeout=2", "gives 'timeout' twice"),
        ("{", "not valid JSON"),
        ("[1]", "must start with 'mooncake://'"),
        ('{"segment": 1}', 'needs "master"'),
        ('{"master": 5}', '"master" must be a string'),
        ('{"master": "h:1", "buffer": true}', "buffer must be a size"),
        ('{"master": "h:1", "protocol": 3}', "protocol must be a string"),
    ],
)
def test_bad_specs_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        parse_store_spec(text)


def test_reads_go_through_the_arena_unless_direct_reads_is_given():
    """Issue 50: direct_reads (reads straight into the pool rows) only when asked."""
    assert (
        parse_store_spec("mooncake://127.0.0.1:50051?local_client=none").direct_reads
        is False
    )
    for text in (
        "mooncake://127.0.0.1:50051?local_client=none&direct_reads=1",
        '{"master": "127.0.0.1:50051", "local_client": null, "direct_reads": true}',
    ):
        spec = parse_store_spec(text)
        assert spec.direct_reads is True, text
        assert parse_store_spec(spec.to_url()) == spec
    assert parse_store_spec("mooncake://h:1?direct_reads=0").direct_reads is False
    with pytest.raises(ValueError, match="direct_reads must be 0 or 1"):
        parse_store_spec("mooncake://127.0.0.1:50051?direct_reads=maybe")
