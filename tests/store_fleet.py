"""A real Mooncake Store for tests (master + client on loopback, killed by pid):
forktool's MooncakeFleet, which `./fork serve --chunk-store local` runs too, plus
the typed spec. No mock: a missing package raises with the install command.

    with MooncakeFleet(tmp_path) as fleet:
        start_server(model, ["--enable-chunk-cache", "--chunk-store", fleet.spec_text])
        fleet.kill_master(); fleet.restart_master()
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from forktool.loopback import interfaces  # noqa: E402
from forktool.mooncake_fleet import (  # noqa: E402
    INSTALL,
    check_installed,
    free_port,
)
from forktool.mooncake_fleet import (
    MooncakeFleet as _Fleet,
)

__all__ = ["INSTALL", "MooncakeFleet", "check_installed", "free_port"]


class MooncakeFleet(_Fleet):
    def __enter__(self):
        # NOTE: Mooncake's transfer engine listens on every interface
        # (forktool/loopback.py);
        # `./fork test` gives the tests a network namespace with only loopback, so those
        # ports are private to the run. Say so where a run has more than loopback.
        if interfaces() != ["lo"]:
            warnings.warn(
                f"the store tests run with interfaces {interfaces()}: Mooncake's "
                "transfer-engine ports listen on every one of them (run the tests "
                "through ./fork test for a loopback-only network namespace)",
                stacklevel=2,
            )
        return super().__enter__()

    def spec(self):
        """The StoreSpec of spec_text (what --chunk-store gives vLLM)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.spec import (  # noqa: E501
            parse_store_spec,
        )

        return parse_store_spec(self.spec_text)
