"""Chapter 01's oracle: our plain-torch models against Hugging Face transformers on the same weights."""

from __future__ import annotations

import math

import pytest
import torch

from minisgl_ref.attention import NoCacheAttentionBackend, reference_attention
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.models import ModelConfig, ModelPathError, load_model, resolve_model_path
from minisgl_ref.models.loader import SHIPPED_CONFIGS, MODEL_REGISTRY
from minisgl_ref.models.weights import checkpoint_shapes, safetensors_files

PROMPTS = [[1, 5, 9, 200, 17, 3, 44], [7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111]]


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


def our_logits(model, sequences):  # type: ignore[no-untyped-def]
    batch = ForwardBatch.for_full_sequences(sequences, NoCacheAttentionBackend())
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch))


def compare_with_hf(folder, sequences):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    ours_model, _, _ = load_model(str(folder), dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = our_logits(ours_model, sequences)
    start = 0
    errors = []
    for seq in sequences:
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0]
        errors.append(relative_error(ours[start : start + len(seq)], ref))
        start += len(seq)
    return errors


@pytest.mark.task("1.3")
@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "qwen2", "qwen3"])
def test_tiny_model_logits_match_transformers(tiny_checkpoints, arch):
    errors = compare_with_hf(tiny_checkpoints[arch], PROMPTS)
    assert max(errors) <= 1e-4, errors


@pytest.mark.task("1.3")
def test_embedded_model_logits_match_transformers(embedded_path):
    errors = compare_with_hf(embedded_path, PROMPTS)
    assert max(errors) <= 1e-4, errors


def test_sharded_checkpoint_is_read_from_all_shards(tiny_checkpoints):
    files = safetensors_files(tiny_checkpoints["qwen3"])
    assert len(files) > 1  # the fixture saved it sharded, so the index path is exercised


@pytest.mark.task("0.1")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("lq,lk", [(5, 5), (1, 9), (3, 7)])
def test_reference_attention_matches_sdpa(heads, kv_heads, lq, lk):
    torch.manual_seed(0)
    q = torch.randn(lq, heads, 16)
    k = torch.randn(lk, kv_heads, 16)
    v = torch.randn(lk, kv_heads, 16)
    ours = reference_attention(q, k, v, scale=16**-0.5)
    # SDPA with an explicit mask: query i sits at absolute position lk - lq + i.
    mask = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + lk - lq)
    kk = k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    vv = v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)
    torch.testing.assert_close(ours, ref.transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.task("1.1")
def test_rotary_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from minisgl_ref.layers.rotary import RotaryEmbedding
    from tests.conftest import tiny_hf_config

    cfg = tiny_hf_config("llama")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    positions = torch.tensor([0, 1, 2, 7, 300, 511])
    q = torch.randn(len(positions), 4, head_dim)
    k = torch.randn(len(positions), 2, head_dim)
    ours_q, ours_k = RotaryEmbedding(head_dim, 512, cfg.rope_parameters["rope_theta"])(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.task("1.2")
def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minisgl_ref.layers.rotary import rope_inv_freq

    hf_cfg = LlamaConfig.from_json_file(SHIPPED_CONFIGS / "llama-3.1-8b.json")
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    cfg = ModelConfig.from_file(SHIPPED_CONFIGS / "llama-3.1-8b.json")
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert not torch.equal(ours, rope_inv_freq(cfg.head_dim, cfg.rope_theta, None))  # scaling changed something


# Parameter counts published for these models (tied embeddings counted once).
EXPECTED_PARAMS = {"qwen3-0.6b": 0.596e9, "qwen3-14b": 14.77e9, "llama-3.1-8b": 8.03e9, "qwen2.5-7b": 7.62e9}


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_shipped_configs_have_the_published_size(name):
    cfg = ModelConfig.from_file(SHIPPED_CONFIGS / f"{name}.json")
    attn = MODEL_REGISTRY[cfg.architecture].decoder_layer_cls.attention_cls
    shapes = checkpoint_shapes(cfg, cfg.attention_bias or attn.qkv_bias_default, attn.use_qk_norm)
    total = sum(math.prod(s) for s in shapes.values())
    assert total == pytest.approx(EXPECTED_PARAMS[name], rel=0.005)


def test_qwen3_kv_bytes_per_token_is_the_design_number():
    cfg = ModelConfig.from_file(SHIPPED_CONFIGS / "qwen3-0.6b.json")
    assert cfg.dtype == torch.bfloat16
    assert cfg.kv_bytes_per_token == 114_688  # design.md's roofline uses this


def test_dummy_weights_build_and_run():
    model, cfg, folder = load_model("qwen3-0.6b", load_format="dummy")
    assert folder is None and cfg.num_layers == 28
    logits = our_logits(model, [[1, 2, 3]])
    assert logits.shape == (3, 151936) and torch.isfinite(logits).all()
    # Same seed, same weights: dummy models are reproducible (tensor-parallel ranks rely on it).
    again, _, _ = load_model("Qwen/Qwen3-0.6B", load_format="dummy")
    assert torch.equal(model.layers[3].mlp.down_proj.weight, again.layers[3].mlp.down_proj.weight)


@pytest.mark.parametrize(
    "path,fmt,fragment",
    [
        ("/nonexistent/model", "auto", "does not exist"),
        ("qwen3-0.6b", "auto", "--load-format dummy"),
        ("qwen3-0.6b", "bogus", "load_format"),
    ],
)
def test_bad_model_paths_explain_themselves(path, fmt, fragment):
    with pytest.raises(ModelPathError, match=fragment):
        resolve_model_path(path, fmt)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelPathError, match="config.json"):
        resolve_model_path(str(tmp_path))
