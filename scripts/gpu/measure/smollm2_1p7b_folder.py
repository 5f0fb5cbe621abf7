"""Write a model folder with SmolLM2-1.7B-Instruct's architecture and the embedded SmolLM2's tokenizer, for
``--load-format dummy`` (random weights): a model twelve times the embedded one's size with the same vocabulary,
so that a grammar compiled for the embedded tokenizer works on it unchanged.

    python3 scripts/gpu/measure/smollm2_1p7b_folder.py OUT [--tokenizer-from FOLDER]

Chapter 12 uses it to time constrained decoding where the forward pass, not the host, paces a decode step. The
architecture numbers are those of the published SmolLM2-1.7B config (24 layers of width 2048, 32 attention heads
and as many KV heads of dimension 64, an MLP of 8192, tied embeddings, RoPE base 130,000); the tokenizer files
are copied from ``FOLDER`` (default: the embedded model's folder, converted on first use).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ARCHITECTURE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 130000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer-from", type=Path, default=None, help="default: the embedded model's folder")
    args = p.parse_args()
    source = args.tokenizer_from
    if source is None:
        from minisgl_ref.models.embedded import embedded_model_path

        source = embedded_model_path()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, args.out / name)
    (args.out / "config.json").write_text(json.dumps(ARCHITECTURE, indent=1) + "\n")
    print(f"wrote {args.out}: SmolLM2-1.7B architecture, tokenizer from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
