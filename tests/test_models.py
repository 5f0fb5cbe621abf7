"""Chapters 00 and 01: attention (task 0.1), RoPE (tasks 1.1, 1.2), the decoder layer (task 1.3), and our
plain-torch models against Hugging Face transformers on the same weights.

Each task is graded on its own: the RoPE tests build only the rotary layer, and the decoder-layer tests replace
our RoPE by transformers' (or by none), so a mistake in one task never shows up as a failure of another. The
whole-model comparisons with our own RoPE, at the top, check everything together.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

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


def compare_with_hf(folder, sequences, rope=None):  # type: ignore[no-untyped-def]
    """Relative error of our logits against transformers' for each sequence. ``rope(hf_config)``, if given, makes
    the RoPE our model uses instead of its own."""
    from transformers import AutoModelForCausalLM

    ours_model, _, _ = load_model(str(folder), dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if rope is not None:
        stand_in = rope(hf.config)
        for layer in ours_model.layers:
            layer.self_attn.rotary = stand_in
    ours = our_logits(ours_model, sequences)
    start = 0
    errors = []
    for seq in sequences:
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0]
        errors.append(relative_error(ours[start : start + len(seq)], ref))
        start += len(seq)
    return errors


@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "qwen2", "qwen3"])
def test_tiny_model_logits_match_transformers(tiny_checkpoints, arch):
    errors = compare_with_hf(tiny_checkpoints[arch], PROMPTS)
    assert max(errors) <= 1e-4, errors


def test_embedded_model_logits_match_transformers(embedded_path):
    errors = compare_with_hf(embedded_path, PROMPTS)
    assert max(errors) <= 1e-4, errors


def test_sharded_checkpoint_is_read_from_all_shards(tiny_checkpoints):
    files = safetensors_files(tiny_checkpoints["qwen3"])
    assert len(files) > 1  # the fixture saved it sharded, so the index path is exercised


# --------------------------------------------------------------------------------------- task 0.1: attention


def naive_attention(q, k, v, scale):  # type: ignore[no-untyped-def]
    """The definition, one query and one head at a time, in float64: query i sits at position Lk - Lq + i and
    sees keys 0 .. Lk - Lq + i; query head h reads KV head h // (H // KVH)."""
    lq, heads, _ = q.shape
    lk, kv_heads, _ = k.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(lq):
        visible = lk - lq + i + 1
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = (k[:visible, g].double() @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(scores, dim=0) @ v[:visible, g].double()
    return out


def random_qkv(lq: int, lk: int, heads: int, kv_heads: int, d: int = 16, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(lq, heads, d, generator=g), torch.randn(lk, kv_heads, d, generator=g),
            torch.randn(lk, kv_heads, d, generator=g))


@pytest.mark.task("0.1")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("lq,lk", [(5, 5), (1, 9), (3, 7)])
def test_reference_attention_matches_sdpa(heads, kv_heads, lq, lk):
    q, k, v = random_qkv(lq, lk, heads, kv_heads)
    ours = reference_attention(q, k, v, scale=16**-0.5)
    # SDPA with an explicit mask: query i sits at absolute position lk - lq + i.
    mask = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + lk - lq)
    kk = k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    vv = v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)
    torch.testing.assert_close(ours, ref.transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.task("0.1")
def test_reference_attention_never_looks_ahead():
    """A prefill: the first query sees only the first key, so its output is exactly v[0]; and changing the last
    key and value changes the last output only."""
    q, k, v = random_qkv(6, 6, 2, 2)
    out = reference_attention(q, k, v, scale=0.25)
    torch.testing.assert_close(out[0], v[0], rtol=1e-6, atol=1e-6)
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 3.0
    v2[-1] -= 5.0
    out2 = reference_attention(q, k2, v2, scale=0.25)
    torch.testing.assert_close(out2[:-1], out[:-1], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out2[-1], out[-1], atol=1e-3)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.task("0.1")
@pytest.mark.parametrize("lq,lk", [(1, 9), (3, 8)])
def test_reference_attention_queries_are_the_newest_positions(lq, lk):
    """Fewer queries than keys: a decode step (one query, sees every key) or the queries after a cached prefix.
    The queries are the *last* Lq positions, not the first."""
    q, k, v = random_qkv(lq, lk, 2, 2, seed=1)
    out = reference_attention(q, k, v, scale=0.25)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.task("0.1")
def test_reference_attention_consecutive_query_heads_share_a_kv_head():
    """8 query heads over 2 KV heads: heads 0-3 read KV head 0 and heads 4-7 read KV head 1. Each KV head's
    values are one constant, so every output shows which KV head its query head read. The output must also
    follow the inputs: with the two KV heads' values swapped, the two halves of the heads swap what they read
    (an answer that ignores its inputs and returns the pattern above fails here)."""
    q, k, _ = random_qkv(4, 4, 8, 2, seed=2)
    v = torch.ones(4, 2, 16)
    v[:, 1] = 7.0
    out = reference_attention(q, k, v, scale=0.25)
    read = out[..., 0].round()  # [Lq, H]: 1.0 or 7.0
    assert read.tolist() == [[1.0] * 4 + [7.0] * 4] * 4
    swapped = reference_attention(q, k, v.flip(1), scale=0.25)[..., 0].round()
    assert swapped.tolist() == [[7.0] * 4 + [1.0] * 4] * 4


@pytest.mark.task("0.1")
def test_reference_attention_scales_the_scores():
    """With scale 0 every visible key scores the same, so query i averages v[0..i]; with a large scale the
    softmax is sharp and the result must still match the definition."""
    q, k, v = random_qkv(5, 5, 2, 1, seed=3)
    flat = reference_attention(q, k, v, scale=0.0)
    running_mean = v.cumsum(0) / torch.arange(1, 6)[:, None, None]  # [5, 1, D]
    torch.testing.assert_close(flat, running_mean.expand(5, 2, 16), rtol=1e-5, atol=1e-5)
    sharp = reference_attention(q, k, v, scale=2.0)
    torch.testing.assert_close(sharp.double(), naive_attention(q, k, v, 2.0), rtol=1e-4, atol=1e-5)


@pytest.mark.task("0.1")
def test_reference_attention_returns_the_input_dtype():
    q, k, v = random_qkv(4, 6, 4, 2, seed=4)
    out = reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=0.25)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 4, 16)
    ref = naive_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------- task 1.1: RoPE


def rope_tables(head_dim: int = 16, max_position: int = 512, theta: float = 10000.0):  # type: ignore[no-untyped-def]
    from minisgl_ref.layers.rotary import RotaryEmbedding

    return RotaryEmbedding(head_dim, max_position, theta)


@pytest.mark.task("1.1")
def test_rotary_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from minisgl_ref.layers.rotary import RotaryEmbedding
    from tests.conftest import tiny_hf_config

    cfg = tiny_hf_config("llama")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    positions = torch.tensor([0, 1, 2, 7, 300, 511])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, head_dim, generator=g)
    k = torch.randn(len(positions), 2, head_dim, generator=g)
    ours_q, ours_k = RotaryEmbedding(head_dim, 512, cfg.rope_parameters["rope_theta"])(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.task("1.1")
def test_rotary_pairs_element_i_with_element_i_plus_half():
    """A unit vector along element i (i < D/2) comes out as (cos, sin) of its angle at elements i and i + D/2:
    the NeoX pairing, rotated by +angle."""
    rope = rope_tables()
    d, position = 16, 3
    for i in (0, 1, 5):
        x = torch.zeros(1, 1, d)
        x[0, 0, i] = 1.0
        q, k = rope(torch.tensor([position]), x, x.clone())
        angle = position * rope_inv_freq_plain(d)[i]
        expected = torch.zeros(d)
        expected[i], expected[i + d // 2] = math.cos(angle), math.sin(angle)
        torch.testing.assert_close(q[0, 0], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k[0, 0], expected, rtol=1e-5, atol=1e-6)


def rope_inv_freq_plain(d: int, theta: float = 10000.0) -> list[float]:
    return [theta ** (-2 * i / d) for i in range(d // 2)]


@pytest.mark.task("1.1")
def test_rotary_rotates_each_token_by_its_own_position():
    """A flat batch holds several requests, so positions restart, repeat and jump: token t is rotated by
    positions[t], and position 0 is no rotation at all."""
    rope = rope_tables()
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    positions = torch.tensor([0, 300, 5, 0, 5])
    out_q, out_k = rope(positions, q, k)
    torch.testing.assert_close(out_q[0], q[0], rtol=0, atol=1e-7)
    torch.testing.assert_close(out_k[3], k[3], rtol=0, atol=1e-7)
    for t, p in enumerate(positions.tolist()):  # each token alone gives the same as in the batch
        alone_q, alone_k = rope(torch.tensor([p]), q[t : t + 1], k[t : t + 1])
        torch.testing.assert_close(out_q[t : t + 1], alone_q, rtol=0, atol=0)
        torch.testing.assert_close(out_k[t : t + 1], alone_k, rtol=0, atol=0)
    assert not torch.allclose(out_q[2], q[2]) and not torch.allclose(out_k[1], k[1])


@pytest.mark.task("1.1")
def test_rotary_scores_depend_only_on_the_distance():
    rope = rope_tables(head_dim=32)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)

    def score(m: int, n: int) -> float:
        return float((rope(torch.tensor([m]), q, k)[0] * rope(torch.tensor([n]), q, k)[1]).sum())

    base = score(3, 0)
    for shift in (1, 17, 200):
        assert score(3 + shift, shift) == pytest.approx(base, rel=1e-4, abs=1e-5)
    assert score(10, 0) != pytest.approx(base, rel=1e-3)
    # A rotation keeps every vector's length.
    out_q, out_k = rope(torch.tensor([77]), q, k)
    torch.testing.assert_close(out_q.norm(), q.norm())
    torch.testing.assert_close(out_k.norm(), k.norm())


@pytest.mark.task("1.1")
def test_rotary_keeps_the_input_dtype():
    rope = rope_tables()
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    positions = torch.tensor([1, 2, 40])
    out_q, out_k = rope(positions, q.bfloat16(), k.bfloat16())
    assert out_q.dtype == out_k.dtype == torch.bfloat16
    ref_q, ref_k = rope(positions, q.bfloat16().float(), k.bfloat16().float())
    torch.testing.assert_close(out_q.float(), ref_q, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out_k.float(), ref_k, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------ task 1.2: llama3 RoPE scaling


def hf_llama3_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:  # type: ignore[type-arg]
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=8 * 4096,
                      rope_parameters=dict(rope_type="llama3", rope_theta=theta, **scaling))
    return ROPE_INIT_FUNCTIONS["llama3"](cfg)[0]


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


LLAMA3_SCALINGS = {
    "short_context": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
    "other_factors": dict(factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0,
                          original_max_position_embeddings=4096),
}


@pytest.mark.task("1.2")
@pytest.mark.parametrize("case", sorted(LLAMA3_SCALINGS))
def test_llama3_rope_other_scalings_match_transformers(case):
    from minisgl_ref.layers.rotary import rope_inv_freq

    scaling = LLAMA3_SCALINGS[case]
    for head_dim, theta in ((16, 500000.0), (128, 500000.0), (64, 10000.0)):
        ours = rope_inv_freq(head_dim, theta, dict(scaling, rope_type="llama3"))
        torch.testing.assert_close(ours, hf_llama3_inv_freq(head_dim, theta, scaling), rtol=0, atol=0)


@pytest.mark.task("1.2")
def test_llama3_rope_bands():
    """Llama-3.1-8B's 64 pairs: short wavelengths kept exactly, long ones divided by the factor exactly, and the
    ones in between strictly in between, rising smoothly from the divided to the kept value."""
    from minisgl_ref.layers.rotary import rope_inv_freq

    cfg = ModelConfig.from_file(SHIPPED_CONFIGS / "llama-3.1-8b.json")
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    scaled = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 8192 / 4, wavelen > 8192 / 1
    middle = ~short & ~long
    assert (short.sum(), middle.sum(), long.sum()) == (29, 6, 29)
    assert torch.equal(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8, rtol=1e-6, atol=0)
    ratio = scaled[middle] / plain[middle]  # 1/8 at the long edge, 1 at the short edge, linear in 8192 / wavelength
    assert ((ratio > 1 / 8) & (ratio < 1)).all()
    assert (ratio[:-1] > ratio[1:]).all()  # pairs run from short to long wavelengths
    smooth = (8192 / wavelen[middle] - 1) / (4 - 1)
    torch.testing.assert_close(ratio, (1 - smooth) / 8 + smooth, rtol=1e-5, atol=0)


@pytest.mark.task("1.2")
def test_llama3_rope_default_band_factors():
    """``low_freq_factor`` and ``high_freq_factor`` may be missing: they default to 1 and 4."""
    from minisgl_ref.layers.rotary import rope_inv_freq

    minimal = dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=64)
    full = dict(minimal, low_freq_factor=1.0, high_freq_factor=4.0)
    assert torch.equal(rope_inv_freq(16, 500000.0, minimal), rope_inv_freq(16, 500000.0, full))
    torch.testing.assert_close(rope_inv_freq(16, 500000.0, minimal),
                               hf_llama3_inv_freq(16, 500000.0, LLAMA3_SCALINGS["short_context"]), rtol=0, atol=0)


# ---------------------------------------------------------------------------------- task 1.3: decoder layer


class TransformersRope(nn.Module):
    """RoPE as transformers computes it, standing in for ours (tasks 1.1 and 1.2) in the decoder-layer tests.
    Same interface as ``RotaryEmbedding.norm_and_rotate``: QK-norm first when the model has one (Qwen3)."""

    def __init__(self, hf_config) -> None:  # type: ignore[no-untyped-def]
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        super().__init__()
        self.rope = LlamaRotaryEmbedding(hf_config)

    def norm_and_rotate(self, positions, q, k, q_norm=None, k_norm=None):  # type: ignore[no-untyped-def]
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = self.rope(q, positions[None])
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1)


class NoRope(nn.Module):
    """QK-norm when the model has one, and no rotation at all: for testing the layer's wiring, any position
    encoding will do."""

    def norm_and_rotate(self, positions, q, k, q_norm=None, k_norm=None):  # type: ignore[no-untyped-def]
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return q, k


def random_layer(tiny_checkpoints, arch: str = "llama"):  # type: ignore[no-untyped-def]
    """A decoder layer of a tiny architecture with random weights, norm weights included (so that using one norm
    in place of the other shows)."""
    cfg = ModelConfig.from_file(tiny_checkpoints[arch] / "config.json")
    torch.manual_seed(5)
    layer = MODEL_REGISTRY[cfg.architecture].decoder_layer_cls(cfg, 0, NoRope())
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.5 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
    return layer, cfg


def plain_pre_norm(layer, positions, x, batch):  # type: ignore[no-untyped-def]
    """The definition: x + attn(norm1(x)), then + mlp(norm2(.)); returns (stream after attention, output)."""
    after_attn = x + layer.self_attn(positions, layer.input_layernorm(x), batch)
    return after_attn, after_attn + layer.mlp(layer.post_attention_layernorm(after_attn))


def layer_inputs(cfg, lengths=(5, 3)):  # type: ignore[no-untyped-def]
    batch = ForwardBatch.for_full_sequences([list(range(n)) for n in lengths], NoCacheAttentionBackend())
    g = torch.Generator().manual_seed(6)
    return batch, torch.randn(sum(lengths), cfg.hidden_size, generator=g)


@pytest.mark.task("1.3")
def test_first_decoder_layer_is_pre_norm_with_residual(tiny_checkpoints):
    """The first layer gets the embeddings and no residual yet."""
    layer, cfg = random_layer(tiny_checkpoints)
    batch, x = layer_inputs(cfg)
    with torch.inference_mode():
        hidden, residual = layer(batch.positions, x, None, batch)
        after_attn, out = plain_pre_norm(layer, batch.positions, x, batch)
    torch.testing.assert_close(hidden + residual, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, after_attn, rtol=1e-5, atol=1e-5)  # the stream, not a normalised copy


@pytest.mark.task("1.3")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_later_decoder_layer_adds_the_incoming_residual(tiny_checkpoints, arch):
    """A later layer gets the stream in two pieces, x = hidden + residual, and must add them first."""
    layer, cfg = random_layer(tiny_checkpoints, arch)
    batch, x = layer_inputs(cfg)
    g = torch.Generator().manual_seed(7)
    piece = torch.randn(x.shape, generator=g)
    with torch.inference_mode():
        hidden, residual = layer(batch.positions, x - piece, piece, batch)
        after_attn, out = plain_pre_norm(layer, batch.positions, x, batch)
    torch.testing.assert_close(hidden + residual, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, after_attn, rtol=1e-5, atol=1e-5)


@pytest.mark.task("1.3")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers_given_its_rope(tiny_checkpoints, arch):
    """The whole model, decoder layers stacked, with transformers' RoPE in place of ours."""
    errors = compare_with_hf(tiny_checkpoints[arch], PROMPTS, rope=TransformersRope)
    assert max(errors) <= 1e-4, errors


@pytest.mark.task("1.3")
def test_embedded_model_matches_transformers_given_its_rope(embedded_path):
    errors = compare_with_hf(embedded_path, PROMPTS, rope=TransformersRope)
    assert max(errors) <= 1e-4, errors


def test_the_final_norm_takes_the_stream_in_one_piece_too(tiny_checkpoints):
    """Layers that keep the whole stream in ``hidden`` hand back ``residual=None`` (chapter 11's folded layers), and
    a model without layers never has a residual: the final norm then normalises ``hidden`` alone."""
    model, _, _ = load_model(str(tiny_checkpoints["llama"]), dtype="float32")
    batch = ForwardBatch.for_full_sequences(PROMPTS, NoCacheAttentionBackend())
    with torch.inference_mode():
        ref = model(batch.input_ids, batch.positions, batch)
        whole = model.embed_tokens(batch.input_ids)
        stream, residual = whole, None
        for layer in model.layers:
            hidden, residual = layer(batch.positions, stream, residual, batch)
            stream, residual = hidden + residual, None  # hand the next layer (and the norm) one piece
        torch.testing.assert_close(model.norm(stream), ref, rtol=1e-5, atol=1e-5)
        model.layers = nn.ModuleList()
        assert torch.equal(model(batch.input_ids, batch.positions, batch), model.norm(whole))


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


@pytest.mark.parametrize(("stored", "device", "asked", "expected"), [
    (torch.float32, "cpu", "auto", torch.float32),
    (torch.bfloat16, "cpu", "auto", torch.float32),  # half precision is slow on a CPU
    (torch.float32, "cuda", "auto", torch.bfloat16),  # a float32 checkpoint runs in 16 bits on a GPU
    (torch.bfloat16, "cuda", "auto", torch.bfloat16),
    (torch.float16, "cuda", "auto", torch.float16),
    (torch.float32, "cuda", "float32", torch.float32),  # unless asked for
    (torch.bfloat16, "cpu", "bfloat16", torch.bfloat16),
])  # fmt: skip
def test_auto_dtype_follows_the_checkpoint_but_not_into_slow_paths(stored, device, asked, expected) -> None:
    import dataclasses

    from minisgl_ref.models.config import ModelConfig
    from minisgl_ref.models.loader import SHIPPED_CONFIGS, resolve_dtype

    config = dataclasses.replace(ModelConfig.from_file(SHIPPED_CONFIGS / "qwen3-0.6b.json"), dtype=stored)
    assert resolve_dtype(asked, config, torch.device(device)) == expected
