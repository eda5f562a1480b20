"""The offline example runs as its docstring says (a newcomer's first run, in a
subprocess with its own engine). The OpenAI client example runs in
test_chunk_cache_server.py, against that module's server."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, models_dir
from tests.e2e.engine import ENGINE_ENV

pytestmark = pytest.mark.e2e


def test_the_offline_documents_example_serves_the_second_order_from_the_cache():
    import os

    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "documents_offline.py"),
            str(models_dir() / "SmolLM2-135M-Instruct"),
        ],
        env={**os.environ, **ENGINE_ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    served = [
        tuple(map(int, m.groups()))
        for m in re.finditer(
            r"prompt tokens served from caches: (\d+) of (\d+)", out.stdout
        )
    ]
    assert len(served) == 2, out.stdout
    # Both requests load every document token (the first through its children), as the
    # example's docstring says; nothing else is cached.
    assert served[0][0] == served[1][0] > 0
