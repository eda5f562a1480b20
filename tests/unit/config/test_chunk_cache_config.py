"""ChunkCacheConfig: defaults, validation at start-up, the EngineArgs / CLI wiring."""

import subprocess
import sys

import pytest
from vllm.config import ChunkCacheConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from tests.conftest import models_dir

TINY = str(models_dir() / "tiny-llama")


def test_defaults_follow_the_spec():
    c = ChunkCacheConfig()
    assert (
        c.enable_chunk_cache,
        c.chunk_separator,
        c.max_chunks,
        c.max_chunk_tokens,
    ) == (False, "##", 500, 4096)
    assert (
        c.chunk_pool_fraction,
        c.chunk_pool_size_gib,
        c.chunk_hash_algo,
        c.chunk_context,
    ) == (0.15, None, "xxhash", "sink")
    assert c.chunk_recompute_tokens == 0  # boundary recompute is opt-in
    assert VllmConfig().chunk_cache_config == ChunkCacheConfig()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunk_separator": ""}, "--chunk-separator must contain a non-whitespace"),
        ({"chunk_separator": "  "}, "--chunk-separator must contain a non-whitespace"),
        (
            {"chunk_separator": " ## "},
            "--chunk-separator must not start or end with whitespace",
        ),
        ({"max_chunks": 0}, "--max-chunks must be >= 1"),
        ({"max_chunk_tokens": -5}, "--max-chunk-tokens must be >= 1"),
        ({"chunk_pool_fraction": 1.5}, "--chunk-pool-fraction must be in"),
        ({"chunk_pool_size_gib": 0}, "--chunk-pool-size-gib must be > 0"),
        ({"chunk_context": "everything"}, "chunk_context"),
        ({"chunk_hash_algo": "md5"}, "chunk_hash_algo"),
        ({"chunk_recompute_tokens": -1}, "--chunk-recompute-tokens must be >= 0"),
    ],
)
def test_bad_values_fail_with_a_message_naming_the_field(kwargs, message):
    with pytest.raises(Exception, match=message):
        ChunkCacheConfig(**kwargs)


def test_engine_args_build_the_config():
    args = EngineArgs(
        model=TINY,
        enable_chunk_cache=True,
        chunk_separator="<doc>",
        max_chunks=8,
        chunk_context="system",
        chunk_pool_size_gib=0.5,
    )
    cfg = args.create_engine_config().chunk_cache_config
    assert cfg == ChunkCacheConfig(
        enable_chunk_cache=True,
        chunk_separator="<doc>",
        max_chunks=8,
        chunk_context="system",
        chunk_pool_size_gib=0.5,
    )


def test_engine_args_reject_bad_values_at_start_up():
    with pytest.raises(Exception, match="--max-chunk-tokens must be >= 1"):
        EngineArgs(
            model=TINY, enable_chunk_cache=True, max_chunk_tokens=0
        ).create_engine_config()


def test_cli_flags_parse_into_engine_args():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(
        [
            "--model",
            TINY,
            "--enable-chunk-cache",
            "--chunk-separator",
            "<<SEP>>",
            "--max-chunks",
            "12",
            "--max-chunk-tokens",
            "256",
            "--chunk-pool-fraction",
            "0.3",
            "--chunk-context",
            "none",
            "--chunk-recompute-tokens",
            "12",
        ]
    )
    args = EngineArgs.from_cli_args(ns)
    assert (
        args.enable_chunk_cache,
        args.chunk_separator,
        args.max_chunks,
        args.max_chunk_tokens,
        args.chunk_pool_fraction,
        args.chunk_context,
        args.chunk_recompute_tokens,
    ) == (True, "<<SEP>>", 12, 256, 0.3, "none", 12)
    assert args.create_engine_config().chunk_cache_config.chunk_recompute_tokens == 12


def test_serve_help_lists_the_flags_with_their_help():
    vllm = str(__import__("pathlib").Path(sys.executable).with_name("vllm"))
    out = subprocess.run(
        [vllm, "serve", "--help=ChunkCacheConfig"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    for flag in (
        "--enable-chunk-cache",
        "--chunk-separator",
        "--max-chunks",
        "--max-chunk-tokens",
        "--chunk-pool-fraction",
        "--chunk-pool-size-gib",
        "--chunk-hash-algo",
        "--chunk-context",
        "--chunk-recompute-tokens",
        "--chunk-store",
    ):
        assert flag in out
    assert "Markdown headings" in out  # the separator's help text, from its docstring


def test_chunk_store_is_off_by_default_and_validated_at_config_time():
    assert ChunkCacheConfig().chunk_store is None
    ok = ChunkCacheConfig(enable_chunk_cache=True, chunk_store="mooncake://127.0.0.1:5")
    assert "store=mooncake://127.0.0.1:5" in ok.describe()
    with pytest.raises(
        ValueError,
        match=r"--chunk-store 'mooncake://127.0.0.1': master "
        r"address must be 'host:port'",
    ):
        ChunkCacheConfig(enable_chunk_cache=True, chunk_store="mooncake://127.0.0.1")
    with pytest.raises(ValueError, match="--chunk-store needs --enable-chunk-cache"):
        ChunkCacheConfig(chunk_store="mooncake://127.0.0.1:5")


def test_chunk_store_flag_reaches_the_config():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    spec = '{"master": "127.0.0.1:50051", "segment": "64MB"}'
    args = EngineArgs.from_cli_args(
        parser.parse_args(
            ["--model", TINY, "--enable-chunk-cache", "--chunk-store", spec]
        )
    )
    assert args.create_engine_config().chunk_cache_config.chunk_store == spec
    bad = EngineArgs.from_cli_args(
        parser.parse_args(
            [
                "--model",
                TINY,
                "--enable-chunk-cache",
                "--chunk-store",
                "mooncake://x:1?a=b",
            ]
        )
    )
    with pytest.raises(Exception, match="--chunk-store .*unknown store spec key"):
        bad.create_engine_config()
