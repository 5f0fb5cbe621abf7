"""Chapter 15: FP8 weights. The formats and scales, the W8A8 linear layer, quantizing an ordinary checkpoint at load
(``quantization="fp8"``), loading a block-scaled FP8 checkpoint in the layout SGLang and vLLM read, and what is
refused by name."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from minisgl_ref.layers.linear import ColumnParallelLinear
from minisgl_ref.models import ModelPathError, load_model
from minisgl_ref.models.embedded import embedded_model_path
from minisgl_ref.quant.fp8 import (
    E4M3,
    E4M3_MAX,
    dequantize_weight,
    expand_block_scale,
    quantize_activation,
    quantize_weight,
    scale_per_block,
)
from minisgl_ref.quant.linear import Fp8LinearMethod, linear_layers
from minisgl_ref.quant.registry import register_quantizations
from tests.test_models import our_logits, relative_error

register_quantizations()  # what build_runtime does; load_model is called directly below


# ------------------------------------------------------------------------------------------ formats and scales


def test_e4m3_rounds_to_within_half_a_step():
    """A value inside e4m3's normal range comes back within half a mantissa step, 2^-4 relative."""
    x = torch.logspace(-5, 8.7, 2000, base=2) * torch.where(torch.rand(2000) > 0.5, 1.0, -1.0)
    back = x.to(E4M3).float()
    assert ((back - x).abs() / x.abs()).max().item() <= 2**-4 + 1e-6
    assert torch.finfo(E4M3).max == E4M3_MAX == 448.0


@pytest.mark.task("15.1", weight=3)
@pytest.mark.parametrize("block", [None, (4, 8), (3, 5)])
def test_weight_quantization_round_trips_with_every_scale_at_the_format_max(block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 16, generator=g) * torch.logspace(-3, 3, 10)[:, None]  # rows of very different ranges
    w[2] = 0.0  # a zero row keeps a finite scale and comes back zero
    q, scale = quantize_weight(w, block)
    assert q.dtype == E4M3
    if block is None:
        assert scale.shape == (10, 1)
    else:
        assert scale.shape == (-(-10 // block[0]), -(-16 // block[1]))  # partial last tiles count
    back = dequantize_weight(q, scale, block)
    assert torch.all(back[2] == 0)
    full = scale if block is None else expand_block_scale(scale, block, (10, 16))
    # Each scale group's largest value lands exactly on 448 (so its own range is used), and every value is
    # within half a step of its group's top.
    assert ((back - w).abs() <= full * E4M3_MAX * 2**-4 + 1e-12).all()
    if block is None:
        assert torch.allclose(q.float().abs().amax(dim=1)[[0, 1, 3]], torch.full((3,), E4M3_MAX))


@pytest.mark.task("15.1", weight=2)
def test_per_channel_scales_keep_small_rows_that_one_scale_loses():
    """One outlier row: with a single per-tensor scale the small rows underflow, with per-row scales they do not."""
    w = torch.full((2, 8), 1e-3)
    w[0] = 1e4
    q_row, s_row = quantize_weight(w)
    assert relative_error(dequantize_weight(q_row, s_row)[1], w[1]) < 0.07
    one = (w.abs().amax() / E4M3_MAX)
    assert (w[1] / one).to(E4M3).float().abs().max() == 0  # the per-tensor scale flushes row 1 to zero


@pytest.mark.task("15.1", weight=2)
def test_block_scale_of_a_tile_is_its_own_amax():
    w = torch.arange(1.0, 1 + 6 * 6).view(6, 6)
    scale = scale_per_block(w, (4, 4))
    assert torch.allclose(scale * E4M3_MAX, torch.tensor([[w[:4, :4].max(), w[:4, 4:].max()],
                                                          [w[4:, :4].max(), w[4:, 4:].max()]]))


@pytest.mark.task("15.1", weight=1)
def test_activation_groups_scale_separately():
    x = torch.cat([torch.full((2, 4), 100.0), torch.full((2, 4), 0.01)], dim=1)
    _, per_token = quantize_activation(x)
    _, per_group = quantize_activation(x, group=4)
    assert per_token.shape == (2, 1) and per_group.shape == (2, 2)
    assert torch.allclose(per_group[:, 1] * E4M3_MAX, torch.tensor([0.01, 0.01]))


# ---------------------------------------------------------------------------------------------- the layer


@pytest.mark.task("15.1", weight=2)
@pytest.mark.parametrize("block", [None, (1, 8)])
def test_the_w8a8_reference_is_the_product_of_the_dequantized_operands(block):
    g = torch.Generator().manual_seed(1)
    layer = ColumnParallelLinear(16, 12, bias=True)
    x = torch.randn(5, 16, generator=g)
    w = torch.randn(12, 16, generator=g)
    layer.bias.data.copy_(torch.randn(12, generator=g))
    q, scale = quantize_weight(w, block)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    if block is None:
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    else:
        layer.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
    layer.quant_method = Fp8LinearMethod(block)
    qx, sx = quantize_activation(x, None if block is None else 8)
    sx = sx if block is None else expand_block_scale(sx, (1, 8), (5, 16))
    expected = (qx.float() * sx) @ dequantize_weight(q, scale, block).t() + layer.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    assert relative_error(layer(x), x @ w.t() + layer.bias) < 0.06  # and close to the full-precision product


# ------------------------------------------------------------------------------ models: quantized at load


@pytest.fixture(scope="module")
def dense_model():
    model, _, _ = load_model(str(embedded_model_path()), dtype="float32")
    return model


@pytest.fixture(scope="module")
def fp8_models():
    return {q: load_model(str(embedded_model_path()), dtype="float32", quantization=q)[0]
            for q in ("fp8", "w8a8_fp8")}


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    """The first 512 tokens of the perplexity text (chapter 15 measures on all of it)."""
    from minisgl_ref.bench.perplexity import default_text
    from minisgl_ref.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(embedded_model_path()).encode(default_text())[:512]


def text_perplexity(model, ids: list[int]) -> float:  # type: ignore[no-untyped-def]
    logits = our_logits(model, [ids]).float()
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


@pytest.mark.parametrize("name, scale_name, scale_cols", [("fp8", "weight_scale_inv", "groups"),
                                                          ("w8a8_fp8", "weight_scale", 1)])
def test_quantization_converts_every_projection_and_nothing_else(fp8_models, name, scale_name, scale_cols):
    model = fp8_models[name]
    layers = linear_layers(model)
    assert len(layers) == 4 * 30  # qkv, o, gate_up and down of SmolLM2-135M's 30 layers
    for _, layer in layers:
        cols = -(-layer.weight.shape[1] // 128) if scale_cols == "groups" else 1
        assert layer.weight.dtype == E4M3 and getattr(layer, scale_name).shape == (layer.weight.shape[0], cols)
        assert isinstance(layer.quant_method, Fp8LinearMethod)
    assert model.lm_head.weight.dtype == torch.float32 and model.embed_tokens.weight.dtype == torch.float32
    fp8_elements = sum(layer.weight.numel() for _, layer in layers)
    assert fp8_elements > 0.6 * sum(p.numel() for p in model.parameters())  # most of the model is now one byte


@pytest.mark.parametrize("name", ["fp8", "w8a8_fp8"])
def test_fp8_weights_cost_a_few_percent_of_perplexity(dense_model, fp8_models, text_ids, name):
    """Not a target (chapter 15 measures the whole text against bf16), a guard: quantized, the model is changed
    but still the same model. e4m3 keeps 3 mantissa bits, ~2.6% error per weight; on 512 tokens of the text the
    perplexity rises by a few percent, and a broken layout (scales of the wrong rows, say) would multiply it."""
    ref, got = text_perplexity(dense_model, text_ids), text_perplexity(fp8_models[name], text_ids)
    assert 1.0 < got / ref < 1.06, (ref, got)


# --------------------------------------------------------------------------- models: an FP8 checkpoint


def write_fp8_checkpoint(dest: Path, block: tuple[int, int] = (128, 128), keep: tuple[str, ...] = (),
                         **qconfig_overrides) -> Path:
    """SmolLM2-135M re-saved as a block-scaled FP8 checkpoint: every projection's weight in e4m3 with its
    ``weight_scale_inv`` tiles (but those whose names contain one of ``keep``, listed as
    ``modules_to_not_convert``), everything else as it was, and the ``quantization_config`` that announces it."""
    from safetensors.torch import load_file, save_file

    src = embedded_model_path()
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dest / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if name.endswith("_proj.weight") and not any(k in name for k in keep):
                q, scale = quantize_weight(t.float(), block)
                tensors[name] = q
                tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
            else:
                tensors[name] = t
    save_file(tensors, str(dest / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)} | qconfig_overrides
    if keep:
        config["quantization_config"]["modules_to_not_convert"] = list(keep)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8"))


@pytest.mark.task("15.1", weight=2)
def test_an_fp8_checkpoint_loads_as_stored(fp8_checkpoint, dense_model, text_ids):
    """Each projection holds exactly the checkpoint's e4m3 values, and its per-row scales are the checkpoint's
    128 x 128 tiles spread over the rows, including the fused q/k/v, whose k rows start mid-tile."""
    from safetensors.torch import load_file

    model, _, _ = load_model(str(fp8_checkpoint), dtype="float32")
    stored = load_file(str(fp8_checkpoint / "model.safetensors"))
    attn = model.layers[3].self_attn
    q_rows = attn.qkv_proj.q_size
    k_name = "model.layers.3.self_attn.k_proj."
    k_block = dequantize_weight(stored[k_name + "weight"], stored[k_name + "weight_scale_inv"], (128, 128))
    k_ours = attn.qkv_proj.weight[q_rows:q_rows + attn.qkv_proj.kv_size]
    k_scale = attn.qkv_proj.weight_scale_inv[q_rows:q_rows + attn.qkv_proj.kv_size]
    assert torch.equal(k_ours.view(torch.uint8), stored[k_name + "weight"].view(torch.uint8))
    assert torch.equal(dequantize_weight(k_ours, k_scale, (1, 128)), k_block)
    assert model.layers[0].mlp.down_proj.quant_method.block == (1, 128)
    ref, got = text_perplexity(dense_model, text_ids), text_perplexity(model, text_ids)
    assert 1.0 < got / ref < 1.06, (ref, got)


def test_an_fp8_checkpoint_keeps_the_layers_it_names_in_full_precision(tmp_path):
    model, _, _ = load_model(str(write_fp8_checkpoint(tmp_path / "keep", keep=("mlp.down_proj",))), dtype="float32")
    assert not model.layers[0].mlp.down_proj.quant_method.quantized
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert isinstance(model.layers[0].mlp.gate_up_proj.quant_method, Fp8LinearMethod)


# ------------------------------------------------------------------------------------- refused by name


def test_unsupported_formats_are_refused_by_name(tmp_path, fp8_checkpoint):
    config = json.loads((fp8_checkpoint / "config.json").read_text())

    def folder_with(qconfig: dict) -> Path:
        f = tmp_path / str(len(list(tmp_path.iterdir())))
        f.mkdir()
        (f / "config.json").write_text(json.dumps(config | {"quantization_config": qconfig}))
        (f / "model.safetensors").symlink_to(fp8_checkpoint / "model.safetensors")
        return f

    with pytest.raises(ModelPathError, match="quant_method 'awq', which is not supported"):
        load_model(str(folder_with({"quant_method": "awq"})))
    base = config["quantization_config"]
    with pytest.raises(ValueError, match="activation_scheme='static'"):
        load_model(str(folder_with(base | {"activation_scheme": "static"})))
    with pytest.raises(ValueError, match="without weight_block_size"):
        load_model(str(folder_with({k: v for k, v in base.items() if k != "weight_block_size"})))
    with pytest.raises(ValueError, match="format 'e5m2'"):
        load_model(str(folder_with(base | {"fmt": "e5m2"})))
    with pytest.raises(ValueError, match="quantization='fp4' asked for a checkpoint already quantized"):
        load_model(str(fp8_checkpoint), quantization="fp4")
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        load_model(str(embedded_model_path()), quantization="int3")


def test_stacked_experts_are_refused_by_name(tmp_path):
    from minisgl_ref.moe.registry import register_moe_models
    from tests.test_moe_models import qwen3_moe_config, save_tiny

    register_moe_models()
    folder = save_tiny(tmp_path, qwen3_moe_config())
    with pytest.raises(ValueError, match="stacked 3-D tensors .* FP8 quantization does not cover"):
        load_model(str(folder), dtype="float32", quantization="fp8")


def test_the_floor_counts_the_bytes_as_stored():
    """``bench offline``'s floor reads what the engine stores: one byte per FP8 weight (plus its scales) and per
    FP8 cache element, not the config's dtype."""
    from minisgl_ref import LLM
    from minisgl_ref.bench.offline import stored_bytes, weight_bytes

    plain = LLM(device="cpu", dtype="bfloat16", max_total_tokens=256)
    both = LLM(device="cpu", dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8_e4m3", max_total_tokens=256)
    w_plain, kv_plain = stored_bytes(plain)
    w_fp8, kv_fp8 = stored_bytes(both)
    assert w_plain == weight_bytes(plain.config) and kv_plain == plain.config.kv_bytes_per_token
    assert kv_fp8 * 2 == kv_plain
    projections = sum(layer.weight.numel() for _, layer in linear_layers(both.model))
    scales = sum(layer.weight_scale_inv.numel() for _, layer in linear_layers(both.model))
    assert w_fp8 == w_plain - projections + 4 * scales  # two bytes became one, plus float32 scales
    plain.shutdown()
    both.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8", "w8a8_fp8"])
def test_gpu_fp8_projections_equal_the_reference(name):
    """On a GPU the projections take the FP8 tensor cores (``torch._scaled_mm`` per channel, the Triton kernel
    for group scales); each equals the dequantizing reference on the same inputs to bf16 rounding, and the
    engine, CUDA graphs on, runs the model."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from minisgl_ref import LLM, SamplingParams

    # Qwen3-0.6B's shapes with random weights (the embedded model is not installed everywhere a GPU is).
    llm = LLM("qwen3-0.6b", load_format="dummy", device="cuda", dtype="bfloat16", quantization=name,
              max_total_tokens=4096)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _, layer in linear_layers(llm.model)[:8]:
        x = torch.randn(37, layer.weight.shape[1], device="cuda", dtype=torch.bfloat16, generator=g)
        fast = layer.quant_method.apply(layer, x, None).float()
        ref = layer.quant_method.reference(layer, x, None).float()
        assert relative_error(fast, ref) < 1e-2
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].output_ids) == 8
    llm.shutdown()
