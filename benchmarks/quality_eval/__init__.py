# SPDX-License-Identifier: Apache-2.0
"""Pieces of the answer-quality evaluation (benchmarks/eval_quality.py): the offline
RAG QA set, the recompute-lever masks, the HF reference scorer and the engine runner."""

import sys
from pathlib import Path

# NOTE: the isolation reference the levers and the HF scorer build on is a test
# oracle, kept out of the wheel (tests/chunk_isolation_mask.py): the repository's
# root on the path finds it when a benchmark runs from benchmarks/.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)
