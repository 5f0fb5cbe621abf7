"""Write the embedded SmolLM2-135M zero-padded into a wider model: the same outputs, a larger model's GPU work.

    python3 scripts/gpu/measure/padded_model.py OUT [--hidden 2048 --heads 32 --intermediate 8192]

A grammar's cost on the host only shows against the forward pass it has to hide behind, so timing constrained
decoding on the 135M model alone says little about a larger one; and a larger model with random weights writes
random bytes, which put a grammar matcher in states (half a UTF-8 character inside a string, say) that real text
seldom reaches and that cost it several times more. This script builds a model with the width of SmolLM2-1.7B
(2048 wide, 32 heads of 64, each with its own KV head, an MLP of 8192; the 135M's 30 layers: about 2.1B
parameters, in bfloat16) whose computation is the 135M's:

* every matrix is the 135M's in its top-left corner and zero elsewhere, so the extra hidden units stay exactly 0;
* the 135M's 9 query heads are heads 0-8, and head ``j`` gets its own copy of the KV head it shared (``j // 3``);
  the other heads have zero queries, keys and values, and ``o_proj`` ignores them;
* RMSNorm divides by the root mean square over all 2048 units, of which 576 are non-zero: the mean is smaller by
  576/2048, so the norm weights are scaled by sqrt(576/2048) and the epsilon by 576/2048, which makes each norm's
  output exactly the 135M's.

The outputs match the 135M's up to bfloat16 rounding (sums over more terms, most of them zero), and the device
reads and multiplies every byte of the larger matrices and KV cache. ``OUT`` gets config.json, model.safetensors
and the tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` in the leading corner of a zero tensor of ``shape``."""
    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def padded_state(state: dict[str, torch.Tensor], cfg: dict, hidden: int, heads: int, inter: int,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The padded model's weights (see the module docstring) from the small model's ``state`` and config."""
    h0, n0, kv0 = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h0 // n0
    group = n0 // kv0
    norm_scale = (h0 / hidden) ** 0.5
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("norm.weight"):
            out[name] = pad(t * norm_scale, (hidden,))
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            out[name] = pad(t, (t.shape[0], hidden))
        elif name.endswith("q_proj.weight"):
            out[name] = pad(t, (heads * d, hidden))
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            # query head j of the small model read KV head j // group: give each its own copy
            per_head = t.view(kv0, d, h0).repeat_interleave(group, dim=0).reshape(n0 * d, h0)
            out[name] = pad(per_head, (heads * d, hidden))
        elif name.endswith("o_proj.weight"):
            out[name] = pad(t, (hidden, heads * d))
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = pad(t, (inter, hidden))
        elif name.endswith("down_proj.weight"):
            out[name] = pad(t, (hidden, inter))
        else:
            raise ValueError(f"unexpected weight {name}")
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--source", type=Path, default=None, help="default: the embedded model's folder")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=8192)
    args = p.parse_args()
    source = args.source
    if source is None:
        from minisgl_ref.models.embedded import embedded_model_path

        source = embedded_model_path()
    cfg = json.loads((source / "config.json").read_text())
    if args.hidden < cfg["hidden_size"] or args.heads < cfg["num_attention_heads"] \
            or args.intermediate < cfg["intermediate_size"]:
        raise SystemExit("the padded model must be at least as wide as the source in every dimension")
    state = padded_state(load_file(source / "model.safetensors"), cfg, args.hidden, args.heads, args.intermediate)
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(state, args.out / "model.safetensors")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    new = dict(cfg, head_dim=head_dim, hidden_size=args.hidden, num_attention_heads=args.heads,
               num_key_value_heads=args.heads, intermediate_size=args.intermediate,
               rms_norm_eps=cfg["rms_norm_eps"] * cfg["hidden_size"] / args.hidden, dtype="bfloat16",
               _model_name_or_path=f"SmolLM2-135M-Instruct zero-padded to width {args.hidden}")
    new.pop("torch_dtype", None)
    (args.out / "config.json").write_text(json.dumps(new, indent=1) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, args.out / name)
    params = sum(t.numel() for t in state.values())
    print(f"wrote {args.out}: width {args.hidden}, {args.heads} heads, MLP {args.intermediate}, "
          f"{cfg['num_hidden_layers']} layers, {params / 1e9:.2f}B parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
