"""Write the dense peer checkpoint: a random Qwen3.5-0.8B-shaped text model (bf16, real tensor names).

    python -m bench.make_dense OUT_DIR

The config is Qwen3.5-0.8B's text config (tests/data/reference; 24 layers,
dense MLP, tied head, 0.75 B params), the weights are random with a real-like scale (as
bench.formats writes the MoE shapes), the tokenizer files are the built-in default
model's. llama.cpp's converter makes GGUF files of it for a comparison.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

from app.default_model import default_model_path
from bench.formats import real_like

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference" / "qwen3.5-0.8b.config.json"
DROP = ("dtype", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "mamba_ssm_dtype", "use_cache")


def main(out: Path) -> None:
    text = {k: v for k, v in json.loads(REFERENCE.read_text())["text_config"].items() if k not in DROP}
    text["max_position_embeddings"] = 32768
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM._from_config(transformers.Qwen3_5TextConfig(**text), dtype=torch.bfloat16)
    real_like(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="4GB")
    source = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
