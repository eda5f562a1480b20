# SPDX-License-Identifier: Apache-2.0
"""Pieces of the answer-quality evaluation (benchmarks/eval_quality.py): the offline
RAG QA set, the recompute-lever masks, the HF reference scorer and the engine runner."""
