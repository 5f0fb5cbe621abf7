"""Chapter 14: the mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers, their routers, how they
plug into the loader, and what is refused by name (contexts beyond a sliding window; the splits over ranks are
test_moe_ep.py's).

The checkpoints are tiny random ones saved by transformers itself (``save_pretrained`` writes one tensor per
expert, as the released checkpoints do), so loading goes through the real name mapping.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.distributed import set_tp_info
from minisgl_ref.models import ModelConfig, ModelPathError, load_model, resolve_model_path
from minisgl_ref.models.loader import MODEL_REGISTRY, SHIPPED_CONFIGS, register_architecture
from minisgl_ref.moe.config import MoEConfig
from minisgl_ref.moe.experts import reference_experts
from minisgl_ref.moe.layer import MoEBlock, use_experts
from minisgl_ref.moe.mixtral import MixtralForCausalLM
from minisgl_ref.moe.qwen3_moe import Qwen3MoeForCausalLM
from minisgl_ref.moe.registry import MOE_ARCHITECTURES, register_moe_models
from minisgl_ref.moe.router import route
from tests.test_models import PROMPTS, our_logits, relative_error

register_moe_models()  # what build_runtime does; the tests below call load_model directly too

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
             max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1)


def qwen3_moe_config(**overrides):  # type: ignore[no-untyped-def]
    from transformers import Qwen3MoeConfig

    kw = SMALL | dict(head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True) | overrides
    return Qwen3MoeConfig(**kw)


def mixtral_config(**overrides):  # type: ignore[no-untyped-def]
    from transformers import MixtralConfig

    return MixtralConfig(**(SMALL | dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2) | overrides))


def mistral_config(**overrides):  # type: ignore[no-untyped-def]
    from transformers import MistralConfig

    return MistralConfig(**(SMALL | dict(intermediate_size=96) | overrides))


def save_tiny(folder: Path, hf_config) -> Path:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    configs = {
        "qwen3_moe": qwen3_moe_config(),
        "qwen3_moe_unnormalised": qwen3_moe_config(norm_topk_prob=False),
        # layers 0 and 2 dense (mlp_only_layers), 1 and 3 sparse
        "qwen3_moe_mixed": qwen3_moe_config(num_hidden_layers=4, mlp_only_layers=[0, 2]),
        "mixtral": mixtral_config(),
        "mistral_window": mistral_config(sliding_window=64),
    }
    return {name: save_tiny(tmp_path_factory.mktemp(name), cfg) for name, cfg in configs.items()}


def hf_logits(folder: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf(torch.tensor([seq])).logits[0] for seq in sequences]


# ------------------------------------------------------------------------------------------------- the models


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_unnormalised", "qwen3_moe_mixed", "mixtral"])
def test_moe_logits_match_transformers(moe_checkpoints, name):
    model, _, _ = load_model(str(moe_checkpoints[name]), dtype="float32")
    ours = our_logits(model, PROMPTS)
    start, errors = 0, []
    for seq, ref in zip(PROMPTS, hf_logits(moe_checkpoints[name], PROMPTS)):
        errors.append(relative_error(ours[start : start + len(seq)], ref))
        start += len(seq)
    assert max(errors) <= 1e-4, errors


def test_the_routers_really_choose(moe_checkpoints):
    """The comparison above means something only if routing is not degenerate: the tokens of the prompts spread
    over most experts, and no expert's stack is left empty."""
    model, _, _ = load_model(str(moe_checkpoints["qwen3_moe"]), dtype="float32")
    block = model.layers[0].mlp
    assert isinstance(block, MoEBlock) and block.gate.weight.abs().sum() > 0
    tokens = model.embed_tokens(torch.tensor(sum(PROMPTS, [])))
    _, ids = route(block.gate(tokens), block.top_k, block.renormalize)
    assert len(ids.unique()) >= 6
    assert all(block.w13[e].abs().sum() > 0 and block.w2[e].abs().sum() > 0 for e in range(block.num_experts))


def test_mixed_layers_follow_the_config(moe_checkpoints):
    from transformers import AutoModelForCausalLM

    model, _, _ = load_model(str(moe_checkpoints["qwen3_moe_mixed"]), dtype="float32")
    assert [isinstance(layer.mlp, MoEBlock) for layer in model.layers] == [False, True, False, True]
    assert model.layers[0].mlp.down_proj.weight.shape == (64, 96)  # the dense width, intermediate_size
    hf = AutoModelForCausalLM.from_pretrained(moe_checkpoints["qwen3_moe_mixed"], dtype=torch.float32)
    torch.testing.assert_close(model.layers[0].mlp.down_proj.weight, hf.model.layers[0].mlp.down_proj.weight)


@pytest.mark.parametrize("step,dense", [(1, []), (2, []), (3, [1]), (1, [0, 5]), (2, [3])])
def test_which_layers_are_sparse_matches_transformers(step, dense):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

    hf_cfg = qwen3_moe_config(num_hidden_layers=6, decoder_sparse_step=step, mlp_only_layers=dense)
    ours = MoEConfig.qwen3_moe(ModelConfig.from_dict(hf_cfg.to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}))
    for i in range(6):
        hf_sparse = isinstance(Qwen3MoeDecoderLayer(hf_cfg, i).mlp, Qwen3MoeSparseMoeBlock)
        assert ours.is_sparse(i) == hf_sparse, (step, dense, i)


def test_a_stacked_checkpoint_loads_the_same(moe_checkpoints, tmp_path):
    """transformers 5 keeps the experts stacked (``experts.gate_up_proj``); a checkpoint saved from its state dict
    has that form, and loads into the same parameters."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = moe_checkpoints["qwen3_moe"]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    stacked, _, _ = load_model(str(tmp_path), dtype="float32")
    per_expert, _, _ = load_model(str(folder), dtype="float32")
    for (name, a), (_, b) in zip(stacked.named_parameters(), per_expert.named_parameters()):
        assert torch.equal(a, b), name


def test_a_missing_expert_is_refused_by_name(moe_checkpoints):
    from minisgl_ref.models.weights import iter_safetensors

    model, _, _ = load_model(str(moe_checkpoints["mixtral"]), dtype="float32")
    gone = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    weights = [(n, t) for n, t in iter_safetensors(moe_checkpoints["mixtral"]) if n != gone]
    with pytest.raises(KeyError, match="layer 1, e.g. expert 5's up"):
        model.load_weights(weights)


def test_generation_through_the_engine_matches_transformers(moe_checkpoints):
    """The real paged engine (torch_native attention, float32, CPU): greedy tokens of every prompt, batched
    together, equal transformers' generate run one prompt at a time."""
    for name in ("qwen3_moe_mixed", "mixtral"):
        llm = LLM(moe_checkpoints[name], device="cpu", dtype="float32", attention_backend="torch_native",
                  max_total_tokens=2048)
        assert_greedy_matches_transformers(llm, moe_checkpoints[name])
        llm.shutdown()


def assert_greedy_matches_transformers(llm: LLM, folder: Path) -> None:
    """Eight greedy tokens of every prompt, batched through ``llm``, equal transformers' ``generate`` on the CPU
    in float32, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    ours = llm.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, ours):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        assert out.output_ids == ref.tolist(), folder.name


def test_the_experts_function_is_a_hook(moe_checkpoints):
    """``use_experts`` swaps the computation of every MoE block of a built model; the block hands it the stacks
    and the router's choice as they are."""
    model, _, _ = load_model(str(moe_checkpoints["qwen3_moe_mixed"]), dtype="float32")
    calls = []

    def spy(hidden, w13, w2, topk_weights, topk_ids):  # type: ignore[no-untyped-def]
        calls.append((w13.shape, topk_ids.shape, topk_weights.dtype))
        return reference_experts(hidden, w13, w2, topk_weights, topk_ids)

    before = our_logits(model, PROMPTS)
    assert use_experts(model, spy) == 2  # the two sparse layers of four
    after = our_logits(model, PROMPTS)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert calls == [((8, 64, 64), (21, 2), torch.float32)] * 2
    use_experts(model, lambda hidden, *rest: torch.zeros_like(hidden))
    assert not torch.allclose(our_logits(model, PROMPTS), before)


def test_norm_folding_leaves_moe_layers_alone(moe_checkpoints):
    """Chapter 11's folded norms multiply the post-attention norm into ``gate_up_proj``, which an MoE block does
    not have: on a GPU, a model with any MoE layer keeps its norms (and its dense layers alone could be folded)."""
    from minisgl_ref.perf import norm_folding

    model, _, _ = load_model(str(moe_checkpoints["qwen3_moe_mixed"]), dtype="float32")
    assert [norm_folding._foldable(layer) for layer in model.layers] == [True, False, True, False]
    with pytest.raises(ValueError, match="cannot be folded"):
        norm_folding.fold_(model)


# ------------------------------------------------------------------------------------------------ the routers


def hf_router(kind: str, logits_weight: torch.Tensor, top_k: int, norm: bool = True):  # type: ignore[no-untyped-def]
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    e, h = logits_weight.shape
    if kind == "qwen3":
        router = Qwen3MoeTopKRouter(qwen3_moe_config(hidden_size=h, num_experts=e, num_experts_per_tok=top_k,
                                                     norm_topk_prob=norm))
    else:
        router = MixtralTopKRouter(mixtral_config(hidden_size=h, num_local_experts=e, num_experts_per_tok=top_k))
    router.weight.data.copy_(logits_weight)
    return router


@pytest.mark.task("14.2", weight=2)
@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_routing_matches_transformers(norm):
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(16, 32, generator=g), torch.randn(10, 32, generator=g)
    _, ref_w, ref_ids = hf_router("qwen3", weight, 4, norm)(x)
    w, ids = route(x @ weight.t(), 4, renormalize=norm)
    assert torch.equal(ids, ref_ids) and w.dtype == torch.float32
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
    sums = w.sum(-1)
    if norm:
        torch.testing.assert_close(sums, torch.ones(10), rtol=1e-6, atol=1e-6)
    else:
        assert (sums < 1).all()


@pytest.mark.task("14.2", weight=2)
def test_mixtral_routing_is_the_softmax_of_the_top_k_logits():
    """Mixtral's paper routes by softmax over the top-k logits; that is exactly softmax, top-k, renormalise."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(50, 8, generator=g) * 3
    top_logits, top_ids = torch.topk(logits, 2, dim=-1)
    w, ids = route(logits, 2, renormalize=True)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(w, torch.softmax(top_logits, dim=-1), rtol=1e-6, atol=1e-7)
    weight, x = torch.randn(8, 32, generator=g), torch.randn(10, 32, generator=g)
    _, ref_w, ref_ids = hf_router("mixtral", weight, 2)(x)
    w, ids = route(x @ weight.t(), 2, renormalize=True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)


def test_routing_refuses_a_top_k_beyond_the_experts():
    with pytest.raises(ValueError, match="top_k"):
        route(torch.zeros(3, 4), 5, renormalize=True)


# ------------------------------------------------------------------------------------- registration, refusals


def test_the_core_loader_does_not_import_moe():
    code = ("import sys; import minisgl_ref.models.loader, minisgl_ref.engine.engine; "
            "assert not [m for m in sys.modules if m.startswith('minisgl_ref.moe')], 'moe imported'; "
            "from minisgl_ref.models.loader import MODEL_REGISTRY; assert 'Qwen3MoeForCausalLM' not in MODEL_REGISTRY")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_build_runtime_registers_the_moe_models():
    """Whoever builds through runtime.build_runtime (offline LLM, server, bench) finds the MoE architectures."""
    code = ("from minisgl_ref.models.loader import MODEL_REGISTRY; import minisgl_ref.runtime as r; "
            "assert 'MixtralForCausalLM' not in MODEL_REGISTRY\n"
            "try:\n    r.build_runtime(r.ModelArgs('/no/such/folder'))\nexcept Exception:\n    pass\n"
            "assert {'MixtralForCausalLM', 'Qwen3MoeForCausalLM'} <= set(MODEL_REGISTRY)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registered_architectures_and_their_guard():
    assert MODEL_REGISTRY["Qwen3MoeForCausalLM"] is Qwen3MoeForCausalLM
    assert MODEL_REGISTRY["MixtralForCausalLM"] is MixtralForCausalLM
    register_moe_models()  # again: harmless
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is already served by LlamaForCausalLM"):
        register_architecture("LlamaForCausalLM", MixtralForCausalLM)
    assert MODEL_REGISTRY["LlamaForCausalLM"].__name__ == "LlamaForCausalLM"


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        qwen3_moe_config().to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ModelPathError, match="'DeepseekV3ForCausalLM' is not supported"):
        load_model(str(tmp_path), load_format="dummy")


def test_mistral_sliding_window_caps_or_refuses_the_context(moe_checkpoints, caplog):
    """Mistral (the Llama class) with a 64-token window and 512 positions: within the window full causal
    attention is the model's attention, so the logits match transformers'; the default context is capped at
    the window (logged), and a longer context asked for is refused by name."""
    folder = moe_checkpoints["mistral_window"]
    config = ModelConfig.from_file(folder / "config.json")
    assert config.sliding_window == 64 and config.max_position_embeddings == 512
    with caplog.at_level(logging.WARNING):
        assert config.usable_context() == 64
    assert "sliding_window=64" in caplog.text
    assert config.usable_context(48) == 48
    with pytest.raises(ValueError, match="context_length=65 exceeds the model's sliding_window=64"):
        config.usable_context(65)
    with pytest.raises(ValueError, match="sliding_window=64"):
        LLM(folder, device="cpu", dtype="float32", context_length=128, max_total_tokens=1024)
    llm = LLM(folder, device="cpu", dtype="float32", max_total_tokens=1024)
    assert llm.context_length == 64
    model, _, _ = load_model(str(folder), dtype="float32")
    seq = list(range(3, 63))  # 60 tokens: inside the window
    assert relative_error(our_logits(model, [seq]), hf_logits(folder, [seq])[0]) <= 1e-4
    llm.shutdown()


def test_a_window_that_is_off_or_wider_changes_nothing():
    qwen25 = ModelConfig.from_file(SHIPPED_CONFIGS / "qwen2.5-7b.json")  # sliding_window 131072, switched off
    assert qwen25.sliding_window is None and qwen25.usable_context() == qwen25.max_position_embeddings
    wide = ModelConfig.from_dict(mistral_config(sliding_window=4096).to_dict() | {"architectures": ["MistralForCausalLM"]})
    assert wide.sliding_window == 4096 and wide.usable_context() == 512


# ------------------------------------------------------------------------------------------- shipped configs


@pytest.mark.parametrize("name,total,active",
                         [("qwen3-30b-a3b", 30.53e9, 3.35e9), ("mixtral-8x7b", 46.70e9, 12.88e9)])
def test_shipped_moe_configs_have_the_published_size(name, total, active):
    """Counted from checkpoint shapes, never allocated: 30.5 B parameters of which 3.3 B active per token
    (Qwen3-30B-A3B), 46.7 B and 12.9 B (Mixtral-8x7B)."""
    config = ModelConfig.from_file(SHIPPED_CONFIGS / f"{name}.json")
    cls = MODEL_REGISTRY[config.architecture]
    shapes = cls.checkpoint_shapes(config)
    params = sum(math.prod(s) for s in shapes.values())
    moe = cls.moe_config(config)
    idle = config.num_layers * (moe.num_experts - moe.top_k) * 3 * moe.intermediate_size * config.hidden_size
    assert params == pytest.approx(total, rel=0.002) and params - idle == pytest.approx(active, rel=0.002)
    assert resolve_model_path(name, "dummy").config_file == SHIPPED_CONFIGS / f"{name}.json"


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_scaled_down_shipped_config_loads_dummy_weights(name, tmp_path):
    """The shipped config with its sizes cut down (the real one needs 61 GB in bf16), everything else as
    shipped: dummy weights load through the checkpoint names, and the model runs."""
    raw = json.loads((SHIPPED_CONFIGS / f"{name}.json").read_text())
    raw |= dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=320)
    raw |= {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 16} if "num_experts" in raw else {
        "num_local_experts": 8}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model, config, _ = load_model(str(tmp_path), load_format="dummy", dtype="float32")
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    assert len(blocks) == 2 and all(b.w13.abs().min() > 0 for b in blocks)  # every slot written
    logits = our_logits(model, [[1, 2, 3]])
    assert logits.shape == (3, 320) and torch.isfinite(logits).all()
    again, _, _ = load_model(str(tmp_path), load_format="dummy", dtype="float32")
    assert torch.equal(blocks[1].w2, [m for m in again.modules() if isinstance(m, MoEBlock)][1].w2)


def test_on_a_cpu_the_reference_loop_stays(moe_checkpoints):
    from minisgl_ref.moe.registry import install_moe_kernels

    model, _, _ = load_model(str(moe_checkpoints["mixtral"]), dtype="float32")
    assert install_moe_kernels(model, torch.device("cpu")) == 0
    assert all(b.experts is reference_experts for b in model.modules() if isinstance(b, MoEBlock))


@pytest.mark.gpu
def test_on_a_gpu_the_engine_runs_the_fused_kernel_in_cuda_graphs(moe_checkpoints):
    """On a GPU the runtime installs the fused expert kernel, CUDA graphs capture it, and the greedy tokens equal
    transformers' on the CPU (float32: the kernel's products are exact, not TF32)."""
    from minisgl_ref.moe.fused_moe import fused_experts

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for name in ("qwen3_moe_mixed", "mixtral"):
        llm = LLM(moe_checkpoints[name], device="cuda", dtype="float32", max_total_tokens=4096)
        blocks = [m for m in llm.model.modules() if isinstance(m, MoEBlock)]
        assert blocks and all(b.experts is fused_experts for b in blocks)
        assert_greedy_matches_transformers(llm, moe_checkpoints[name])
        llm.shutdown()
