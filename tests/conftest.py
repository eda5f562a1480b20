"""Shared test setup. `./fork test` runs pytest inside the fork's venv, after set-up."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The patch-series tool is plain stdlib Python under tools/.
sys.path.insert(0, str(REPO / "tools"))


def models_dir() -> Path:
    """Where `./fork setup` put the models (FORK_MODELS is set by `./fork test`)."""
    return Path(os.environ.get("FORK_MODELS", REPO / ".cache" / "models"))
