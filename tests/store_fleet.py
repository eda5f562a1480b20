"""A real Mooncake Store for tests (master + client on loopback, killed by pid):
forktool's MooncakeFleet, which `./fork serve --chunk-store local` runs too, plus
the typed spec. No mock: a missing package raises with the install command.

    with MooncakeFleet(tmp_path) as fleet:
        start_server(model, ["--enable-chunk-cache", "--chunk-store", fleet.spec_text])
        fleet.kill_master(); fleet.restart_master()
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from forktool.mooncake_fleet import (  # noqa: E402
    INSTALL,
    MooncakeFleet as _Fleet,
    check_installed,
    free_port,
)

__all__ = ["INSTALL", "MooncakeFleet", "check_installed", "free_port"]


class MooncakeFleet(_Fleet):
    def spec(self):
        """The StoreSpec of spec_text (what --chunk-store gives vLLM)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.chunk_cache.store.spec import (
            parse_store_spec,
        )

        return parse_store_spec(self.spec_text)
