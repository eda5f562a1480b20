"""models: the embedded default model (SmolLM2-135M-Instruct), the tiny random Llama and
the tiny random DeepSeek (MLA: the HF reference, and vLLM 0.32's CPU_MLA)."""

from __future__ import annotations

import shutil
from pathlib import Path

from .paths import Paths
from .progress import run, step

SMOLLM2 = "SmolLM2-135M-Instruct"
TINY = "tiny-llama"
TINY_DEEPSEEK = "tiny-deepseek"
TINY_DEEPSEEK_V32 = "tiny-deepseek-v32"
_SCRIPTS = Path(__file__).resolve().parents[1] / "models"


def ensure_models(paths: Paths, python: Path, smollm2_wheel: Path) -> dict[str, Path]:
    out = {}
    for name, script, args, note in (
        (SMOLLM2, "convert_smollm2.py", [str(smollm2_wheel)], "~45 s, ~1 GB of memory"),
        (TINY, "make_tiny_llama.py", [], "~10 s"),
        (TINY_DEEPSEEK, "make_tiny_deepseek.py", [], "~10 s"),
        (TINY_DEEPSEEK_V32, "make_tiny_deepseek_v32.py", [], "~10 s"),
    ):
        dest = paths.models / name
        done = dest / ".complete"
        if not done.exists():
            shutil.rmtree(dest, ignore_errors=True)
            with step(f"preparing model {name} into {dest} ({note}, once)"):
                run([str(python), str(_SCRIPTS / script), *args, str(dest)], quiet=True)
            done.write_text("ok\n")
        out[name] = dest
    return out
