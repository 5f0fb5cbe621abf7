"""Norm folding (``minisgl_ref.perf.norm_folding``): the folded forward computes the same model.

On the CPU the folded forward runs its plain-PyTorch path in float32 and must agree with the unfolded one to
float32 rounding; the two Triton kernels that finish the norms run in Triton's interpreter against plain ops.
On a GPU (``-m gpu``) the folded Qwen3-0.6B (bf16, random weights, the Triton kernels) is held to the unfolded
one within bf16 rounding, in prefill and decode steps through the engine's KV cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

from minisgl_ref.attention import NoCacheAttentionBackend
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.models import load_model
from minisgl_ref.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from minisgl_ref.perf import kernels, model_transforms, norm_folding
from minisgl_ref.perf.norm_folding import FoldedDecoderLayer
from minisgl_ref.perf.row_rms import divide_by_rms_, rms_reciprocal
from tests.engine_fixtures import tiny_engine_path, tiny_llm  # noqa: F401 (fixtures)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[1, 5, 9, 200, 17, 3, 44], [7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111]]


def logits(model, sequences):  # type: ignore[no-untyped-def]
    device = next(model.parameters()).device
    batch = ForwardBatch.for_full_sequences(sequences, NoCacheAttentionBackend(), device)
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch))


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def randomise_norms(model) -> None:  # type: ignore[no-untyped-def]
    """Norm weights away from 1 (a fresh checkpoint has ones), so that folding them in changes the projections."""
    g = torch.Generator().manual_seed(3)
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data = (1 + 0.5 * torch.randn(norm.weight.shape, generator=g)).to(norm.weight)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_folded_forward_matches_the_plain_one_in_float32(tiny_checkpoints, arch):
    model, _, _ = load_model(str(tiny_checkpoints[arch]), dtype="float32")
    assert not norm_folding.is_folded(model)  # the loader never folds: the plain path stays the oracle
    randomise_norms(model)
    folded = copy.deepcopy(model)
    norm_folding.fold_(folded)
    assert norm_folding.is_folded(folded)
    layer, before = folded.layers[0], model.layers[0]
    assert isinstance(layer, FoldedDecoderLayer)
    # the projections now hold the norm weights: W * g, column by column
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight,
                               before.self_attn.qkv_proj.weight * before.input_layernorm.weight)
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight,
                               before.mlp.gate_up_proj.weight * before.post_attention_layernorm.weight)
    assert folded.state_dict().keys() == model.state_dict().keys()  # the same parameters, under the same names
    ref, ours = logits(model, PROMPTS), logits(folded, PROMPTS)
    assert relative_error(ours, ref) < 1e-5
    assert relative_error(logits(folded, PROMPTS[1:]), ref[len(PROMPTS[0]):]) < 1e-5  # batch-independent
    with pytest.raises(ValueError, match="folded already"):
        norm_folding.fold_(folded)


def test_folding_changes_one_built_model_not_its_class(tiny_checkpoints):
    """``fold_`` rewrites the model it is given: another instance of the same class, built before or after, keeps
    chapter 01's layers and computes exactly what it did."""
    path = str(tiny_checkpoints["llama"])
    methods = (LlamaForCausalLM.forward, LlamaDecoderLayer.forward)
    model, _, _ = load_model(path, dtype="float32")
    twin, _, _ = load_model(path, dtype="float32")
    ref = logits(twin, PROMPTS)
    norm_folding.fold_(model)
    after, _, _ = load_model(path, dtype="float32")
    for other in (twin, after):
        assert type(other) is type(model) and not norm_folding.is_folded(other)
        assert all(type(layer) is LlamaDecoderLayer for layer in other.layers)
        assert torch.equal(logits(other, PROMPTS), ref)
    assert (LlamaForCausalLM.forward, LlamaDecoderLayer.forward) == methods
    assert all(type(layer) is FoldedDecoderLayer for layer in model.layers)


def test_a_folded_layer_takes_the_stream_in_two_pieces_too(tiny_checkpoints):
    """Called the chapter-01 way with a residual, a folded layer adds the two pieces and returns the whole stream
    with ``residual=None`` (what it returns when it gets the stream in one piece)."""
    model, _, _ = load_model(str(tiny_checkpoints["qwen3"]), dtype="float32")
    randomise_norms(model)
    norm_folding.fold_(model)
    layer = model.layers[1]
    batch = ForwardBatch.for_full_sequences(PROMPTS, NoCacheAttentionBackend(), torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    hidden, residual = (torch.randn(len(batch.input_ids), model.config.hidden_size, generator=g) for _ in range(2))
    with torch.inference_mode():
        whole, none = layer(batch.positions, hidden + residual, None, batch)
        split, also_none = layer(batch.positions, hidden, residual, batch)
    assert none is None and also_none is None
    assert torch.equal(split, whole)


def test_a_transformed_model_serves_the_oracle_tokens(tiny_llm):
    """The paged engine (chunked prefill, radix cache, a real KV pool) on the tiny model with chapter 11's model
    transforms, the store in the RoPE kernel and folded norms (their plain paths, on the CPU), generates the
    chapter-00 oracle's greedy tokens from the untouched model."""
    from minisgl_ref import SamplingParams
    from minisgl_ref.core.config import EngineConfig
    from minisgl_ref.engine.engine import Engine
    from minisgl_ref.perf.rope_store import RopeStoreAttention, store_kv_in_rope_
    from tests.engine_fixtures import assert_matches_oracle, drive, make_reqs, oracle

    model = copy.deepcopy(tiny_llm.model)
    store_kv_in_rope_(model)
    assert all(isinstance(layer.self_attn, RopeStoreAttention) for layer in model.layers)
    norm_folding.fold_(model)
    engine = Engine(model, tiny_llm.config, EngineConfig(chunked_prefill_size=16), device="cpu",
                    context_length=tiny_llm.context_length)
    prompts = [[5, 9, 13, 200, 31], [7] * 11, list(range(30, 70)), [5, 9, 13, 200, 31, 8]]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    assert_matches_oracle(reqs, oracle(tiny_llm, prompts, params))


def test_build_runtime_applies_the_model_transforms_to_the_model_it_loads(tiny_engine_path, monkeypatch):
    """``build_runtime`` hands the model it has just loaded, with its device and dtype, to the model transforms;
    on a CPU they change nothing: chapter 01's layers, the kernel table's plain entries."""
    from minisgl_ref.core.config import ModelArgs
    from minisgl_ref.layers.kernel_table import KERNELS
    from minisgl_ref.runtime import build_runtime

    seen, apply_ = [], model_transforms.apply_

    def spy(model, device, dtype):  # type: ignore[no-untyped-def]
        seen.append((model, device, dtype, apply_(model, device, dtype)))
        return seen[-1][-1]

    monkeypatch.setattr("minisgl_ref.runtime.model_transforms.apply_", spy)
    table = {name: getattr(KERNELS, name) for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "qk_norm_rope",
                                                        "store_kv")}
    runtime = build_runtime(ModelArgs(str(tiny_engine_path), device="cpu"), kind="naive")
    assert len(seen) == 1 and seen[0][0] is runtime.model
    assert seen[0][1:] == (torch.device("cpu"), torch.float32, [])
    assert all(type(layer) is LlamaDecoderLayer for layer in runtime.model.layers)
    assert {name: getattr(KERNELS, name) for name in table} == table


def test_a_projection_bias_is_not_folded(tiny_checkpoints):
    """Qwen2's q/k/v bias would be divided by the rms too: such a model keeps its norms."""
    model, _, _ = load_model(str(tiny_checkpoints["qwen2"]), dtype="float32")
    assert not norm_folding.should_fold(model, torch.device(DEVICE), torch.bfloat16)
    with pytest.raises(ValueError, match="cannot be folded"):
        norm_folding.fold_(model)


def test_folding_needs_the_triton_kernels_and_can_be_turned_off(tiny_checkpoints, monkeypatch):
    model, _, _ = load_model(str(tiny_checkpoints["qwen3"]), dtype="float32")
    assert not norm_folding.should_fold(model, torch.device("cpu"), torch.bfloat16)  # no kernels on a CPU
    monkeypatch.setenv("MINISGL_FOLD_NORMS", "0")
    assert not norm_folding.should_fold(model, torch.device(DEVICE), torch.bfloat16)


def test_accumulate_adds_the_projection_into_its_output():
    from minisgl_ref.layers.linear import RowParallelLinear

    lin = RowParallelLinear(6, 4)
    lin.weight.data = torch.randn(4, 6)
    x, out = torch.randn(3, 6), torch.randn(3, 4)
    expected = out + x @ lin.weight.T
    assert norm_folding.accumulate_(lin, out, x) is out
    torch.testing.assert_close(out, expected)
    biased = RowParallelLinear(6, 4, bias=True)
    with pytest.raises(ValueError, match="no bias"):
        norm_folding.accumulate_(biased, out, x)


# ------------------------------------------------------------------------------ the kernels that finish the norms

triton = pytest.importorskip("triton")
from minisgl_ref.perf import triton_ops  # noqa: E402
from minisgl_ref.layers.rotary import RotaryEmbedding  # noqa: E402

needs_compiled = pytest.mark.skipif(DEVICE == "cpu" and type(triton.language.cdiv).__name__ == "JITFunction",
                                    reason="triton was imported before TRITON_INTERPRET=1 was set")


@needs_compiled
@pytest.mark.parametrize("shape", [(3, 8, 40), (5, 64, 1500), (1, 96, 3072)], ids=["tiny", "odd", "qwen3"])
def test_silu_and_mul_rms_matches_plain(shape):
    tokens, hidden, inter = shape
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(tokens, 2 * inter, generator=g).to(DEVICE)
    x = (3 * torch.randn(tokens, hidden, generator=g)).to(DEVICE)
    r = rms_reciprocal(x, 1e-6)
    gate, up = (gate_up * r).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = triton_ops.silu_and_mul_rms(gate_up, x, 1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="silu_and_mul_rms needs"):
        triton_ops.silu_and_mul_rms(gate_up, x[:-1] if tokens > 1 else x.t(), 1e-6)


@needs_compiled
@pytest.mark.parametrize("with_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("store", [True, False], ids=["store", "no-store"])
def test_qk_norm_rope_divides_q_k_and_v_by_the_row_rms(with_norm, store):
    """``row_rms`` is the plain division of q, k and v by each token's rms, followed by the usual kernel: v is
    divided in place, and with ``store`` the pool receives the divided values."""
    tokens, heads, kv_heads, head_dim, hidden = 4, 4, 2, 64, 80
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE)
    x = (2 * torch.randn(tokens, hidden, generator=g)).to(DEVICE)
    rope = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE)
    positions = torch.tensor([0, 4095, 17, 3], device=DEVICE)
    norms = [torch.randn(head_dim, generator=g).to(DEVICE) for _ in range(2)] if with_norm else []
    weights = (*norms, 1e-6) if with_norm else ()

    def views(t):  # type: ignore[no-untyped-def]
        q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
        return (t[:, :q_end].view(tokens, heads, head_dim), t[:, q_end:k_end].view(tokens, kv_heads, head_dim),
                t[:, k_end:].view(tokens, kv_heads, head_dim))

    ref_qkv = divide_by_rms_(qkv.clone(), x, 1e-6)
    rq, rk, rv = views(ref_qkv)
    rq, rk = triton_ops.qk_norm_rope_(positions, rq, rk, rope.cos_cache, rope.sin_cache, *weights)
    q, k, v = views(qkv)
    pools = torch.zeros(2, 16, kv_heads, head_dim, device=DEVICE)
    slots = torch.tensor([9, 0, 15, 4], device=DEVICE)
    kv = (v, pools[0], pools[1], slots) if store else None
    q, k = triton_ops.qk_norm_rope_(positions, q, k, rope.cos_cache, rope.sin_cache, *weights, store=kv,
                                      row_rms=(x, v, 1e-6))
    for ours, ref in ((q, rq), (k, rk), (v, rv)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    if store:
        torch.testing.assert_close(pools[0][slots], rk, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pools[1][slots], rv, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="row_rms needs"):
        triton_ops.qk_norm_rope_(positions, q, k, rope.cos_cache, rope.sin_cache, row_rms=(x[:2], v, 1e-6))


# ------------------------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_gpu_qwen3_folds_and_is_as_accurate_as_the_unfolded_model():
    """Qwen3-0.6B's config with random weights: the model transforms fold it in bf16 on a GPU, and the folded
    model's logits are as close to the float32 model's as the unfolded bf16 model's are (folding moves bf16's
    roundings, it must not add error beyond them). Both bf16 models run with the fused kernels installed, as the
    engine runs them."""
    cuda = torch.device("cuda")
    exact, _, _ = load_model("qwen3-0.6b", load_format="dummy", dtype="float32", device="cuda")
    assert not norm_folding.should_fold(exact, cuda, torch.float32)  # float32: no Triton kernels, nothing folds
    randomise_norms(exact)
    plain, _, _ = load_model("qwen3-0.6b", load_format="dummy", dtype="bfloat16", device="cuda")
    assert not norm_folding.is_folded(plain)  # loading alone never folds
    plain.load_state_dict({k: v.to(torch.bfloat16) for k, v in exact.state_dict().items()})
    folded = copy.deepcopy(plain)
    assert norm_folding.should_fold(folded, cuda, torch.bfloat16)
    norm_folding.fold_(folded)
    seqs = [list(range(7, 7 + n)) for n in (1, 33, 300)]
    ref = logits(exact, seqs)
    with kernels.installed():
        plain_error, folded_error = relative_error(logits(plain, seqs), ref), relative_error(logits(folded, seqs), ref)
    print(f"relative error against float32: unfolded bf16 {plain_error:.2e}, folded bf16 {folded_error:.2e}")
    assert 0 < plain_error < 5e-2
    assert folded_error < 1.25 * plain_error
    served, _, _ = load_model("qwen3-0.6b", load_format="dummy", dtype="bfloat16", device="cuda")
    with kernels.installed():  # the table as it was afterwards (apply_ installs the fused entries for the process)
        assert "folded norms" in model_transforms.apply_(served, cuda, torch.bfloat16)
    assert norm_folding.is_folded(served) and all(type(layer) is FoldedDecoderLayer for layer in served.layers)
