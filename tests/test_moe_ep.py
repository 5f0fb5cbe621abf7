"""Chapter 14: expert parallelism (``--ep-size``), each group of ranks holding E / ep experts, sliced over its
tp / ep ranks (whole at ep = tp, a slice of every expert at ep = 1).

The masked local computation is checked in one process: the partial outputs of every rank sum to the whole layer,
for the reference loop and the fused kernel (Triton's interpreter on a CPU), with routings that spread the pairs,
put them all on one rank's experts, or leave a rank nothing. Loading is checked in one process too (each rank's
stacks are its block of the single-process model's). The models are checked on two CPU ranks with gloo, as chapter
09's tests do: logits at tp = ep = 2, at tp = 2 with ep = 1 and at tp = 4 with ep = 2 within 1e-5 of one process,
greedy tokens equal through the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.tp import model_logits, relative_error
from minisgl_ref.core.config import TPArgs
from minisgl_ref.distributed import set_tp_info
from minisgl_ref.distributed.group import DistConfig
from minisgl_ref.models import ModelConfig, load_model
from minisgl_ref.moe.ep import expert_parallel_experts, local_experts, localize_routing
from minisgl_ref.moe.experts import reference_experts
from minisgl_ref.moe.layer import MoEBlock
from minisgl_ref.moe.registry import MOE_ARCHITECTURES, register_moe_models
from minisgl_ref.tp.launch import call_each, run_on_ranks
from tests.test_moe_models import mixtral_config, qwen3_moe_config, save_tiny

register_moe_models()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEQUENCES = [[1, 5, 9, 200, 17, 3, 44], [7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111]]


# ------------------------------------------------------------------------------ the masked local computation


def make_layer(tokens: int, num_experts: int, top_k: int, ids: torch.Tensor | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h, i = 32, 16
    x = torch.randn(tokens, h, generator=g)
    w13 = torch.randn(num_experts, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(num_experts, h, i, generator=g) / i**0.5
    if ids is None:
        ids = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    # On a GPU machine the fused kernel runs compiled, on CUDA tensors (the interpreter only without one).
    return tuple(t.to(DEVICE) for t in (x, w13, w2, weights / weights.sum(dim=1, keepdim=True), ids))


def fused():  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    from minisgl_ref.moe.fused_moe import fused_experts

    return fused_experts


ROUTINGS = {
    "random": None,
    # every pair on rank 0's experts (0..3 of 8 at ep = 2): rank 1 computes nothing and must add zeros
    "all_on_rank_0": torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]]),
    # every pair on the last rank's experts, at ep = 4 too
    "all_on_last_rank": torch.tensor([[7, 6], [6, 7], [7, 6], [6, 7], [7, 6]]),
    "one_token": torch.tensor([[5, 2]]),
}


@pytest.mark.parametrize("impl", ["reference", "fused"])
@pytest.mark.parametrize("ep_size", [2, 4])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_partial_outputs_sum_to_the_whole_layer(impl, ep_size, routing):
    experts_fn = reference_experts if impl == "reference" else fused()
    ids = ROUTINGS[routing]
    x, w13, w2, weights, ids = make_layer(37 if ids is None else ids.shape[0], 8, 2, ids)
    whole = reference_experts(x, w13, w2, weights, ids)
    partials = []
    for rank in range(ep_size):
        local = local_experts(rank, ep_size, 8)
        fn = expert_parallel_experts(experts_fn, rank, ep_size, 8)
        partials.append(fn(x, w13[local.start:local.stop], w2[local.start:local.stop], weights, ids))
    torch.testing.assert_close(sum(partials), whole, rtol=1e-5, atol=1e-5)
    for rank, partial in enumerate(partials):  # a rank that holds none of the chosen experts adds exactly zero
        if not ((ids >= rank * 8 // ep_size) & (ids < (rank + 1) * 8 // ep_size)).any():
            assert torch.equal(partial, torch.zeros_like(partial))


def test_localize_routing_renumbers_mine_and_masks_the_rest():
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    ids = torch.tensor([[5, 1], [2, 3]])
    w, i = localize_routing(weights, ids, range(2, 4))  # rank 1 of 2, with 4 experts
    assert i.tolist() == [[-1, -1], [0, 1]]
    assert w.tolist() == [[0.0, 0.0], [pytest.approx(0.7), pytest.approx(0.3)]]


def test_local_experts_are_contiguous_blocks_and_an_uneven_split_is_refused():
    assert [local_experts(r, 4, 128) for r in range(4)] == [range(0, 32), range(32, 64), range(64, 96),
                                                           range(96, 128)]
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by ep_size \(4\)"):
        local_experts(0, 4, 6)
    with pytest.raises(ValueError, match="holds 4 experts, got stacks of 8"):
        expert_parallel_experts(reference_experts, 0, 2, 8)(*make_layer(3, 8, 2))  # whole stacks, not rank 0's


# ------------------------------------------------------------------------------------ what is refused, by name


def test_ep_size_must_divide_the_tp_size():
    for bad in (dict(tp_size=2, ep_size=4), dict(tp_size=1, ep_size=2), dict(tp_size=4, ep_size=3),
                dict(tp_size=2, ep_size=0)):
        with pytest.raises(ValueError, match=rf"ep_size \({bad['ep_size']}\) must divide tp_size "
                                             rf"\({bad['tp_size']}\)"):
            TPArgs(**bad)
        with pytest.raises(ValueError, match="ep_size"):
            DistConfig(**bad)
    assert DistConfig.of(TPArgs(tp_size=2, ep_size=2), 1).ep_size == 2
    assert TPArgs(tp_size=4, ep_size=2).ep_size == 2 and TPArgs(tp_size=4, ep_size=1).ep_size == 1
    from minisgl_ref import LLM

    with pytest.raises(ValueError, match=r"ep_size \(2\) must divide tp_size \(1\)"):
        LLM(device="cpu", ep_size=2)  # refused before anything is loaded or started


def test_the_cli_and_server_take_ep_size():
    from minisgl_ref.cli import build_parser
    from minisgl_ref.core.config import from_flags
    from minisgl_ref.server.args import ServerArgs

    args = build_parser().parse_args(["serve", "--device", "cpu", "--tp-size", "2", "--ep-size", "2"])
    assert from_flags(TPArgs, args) == TPArgs(tp_size=2, ep_size=2)
    assert ServerArgs.from_cli(args).tp.ep_size == 2
    bad = build_parser().parse_args(["serve", "--device", "cpu", "--tp-size", "2", "--ep-size", "3"])
    with pytest.raises(ValueError, match=r"ep_size \(3\) must divide tp_size \(2\)"):
        ServerArgs.from_cli(bad)


@pytest.mark.parametrize("arch", sorted(MOE_ARCHITECTURES))
def test_an_uneven_split_of_experts_or_of_their_width_is_refused(arch):
    def build(**overrides):  # type: ignore[no-untyped-def]
        cfg = qwen3_moe_config(**overrides) if arch.startswith("Qwen3") else mixtral_config(
            **{("num_local_experts" if k == "num_experts" else "intermediate_size"): v for k, v in overrides.items()})
        return MOE_ARCHITECTURES[arch](ModelConfig.from_dict(cfg.to_dict() | {"architectures": [arch]}))

    width = "moe_intermediate_size" if arch.startswith("Qwen3") else "intermediate_size"
    try:
        set_tp_info(0, 4, 4)
        with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by ep_size \(4\)"):
            build(num_experts=6)
        set_tp_info(1, 4, 1)  # every expert's width over the 4 ranks
        with pytest.raises(ValueError, match=r"intermediate size \(30\) is not divisible by tp_size / ep_size \(4\)"):
            build(**{width: 30})
        set_tp_info(1, 4, 2)  # experts split in 2 groups, each expert's width (28) over 2 ranks
        blocks = [m for m in build(**{width: 28}).modules() if isinstance(m, MoEBlock)]
        assert blocks and all(b.w13.shape[:2] == (4, 28) and b.w2.shape[1:] == (64, 14) for b in blocks)
    finally:
        set_tp_info(0, 1)


# ------------------------------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Qwen3-MoE (8 experts, top-2, layer 0 dense) and Mixtral (8 experts) saved by transformers, and
    a folder holding only a Qwen3-MoE config (dummy weights)."""
    out = {"qwen3_moe": save_tiny(tmp_path_factory.mktemp("q"), qwen3_moe_config(num_hidden_layers=3,
                                                                                   mlp_only_layers=[0])),
           "mixtral": save_tiny(tmp_path_factory.mktemp("m"), mixtral_config())}
    dummy = tmp_path_factory.mktemp("dummy")
    (dummy / "config.json").write_text((out["qwen3_moe"] / "config.json").read_text())
    out["dummy"] = dummy
    return out


def _stacks(path: Path, load_format: str, rank: int, size: int, ep_size: int | None = None
            ) -> list[tuple[torch.Tensor, ...]]:
    set_tp_info(rank, size, size if ep_size is None else ep_size)
    try:
        model, _, _ = load_model(str(path), load_format=load_format, dtype="float32")
    finally:
        set_tp_info(0, 1)
    return [(m.gate.weight, m.w13, m.w2) for m in model.modules() if isinstance(m, MoEBlock)]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "dummy"])
def test_each_rank_loads_its_block_of_experts_and_the_whole_router(checkpoints, name):
    """Loading needs no process group: each rank's stacks are rows [r E/2, (r+1) E/2) of one process's stacks;
    dummy weights too (seeded by tensor name, so every rank draws the same global tensors)."""
    fmt = "dummy" if name == "dummy" else "auto"
    whole = _stacks(checkpoints[name], fmt, 0, 1)
    assert whole and all(w13.shape[0] == 8 for _, w13, _ in whole)
    for rank in range(2):
        for (gate, w13, w2), (g, a, b) in zip(_stacks(checkpoints[name], fmt, rank, 2), whole):
            assert torch.equal(gate, g)
            assert torch.equal(w13, a[4 * rank:4 * rank + 4]) and torch.equal(w2, b[4 * rank:4 * rank + 4])


def sliced(w13: torch.Tensor, w2: torch.Tensor, part: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice ``part`` of ``parts`` of the width of whole stacks: its gate rows, its up rows, its down columns."""
    i = w2.shape[2]
    w = i // parts
    rows = torch.cat([w13[:, part * w:(part + 1) * w], w13[:, i + part * w:i + (part + 1) * w]], dim=1)
    return rows, w2[:, :, part * w:(part + 1) * w]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "dummy"])
@pytest.mark.parametrize("tp, ep", [(2, 1), (4, 2)])
def test_each_rank_loads_its_slice_of_its_experts(checkpoints, name, tp, ep):
    """With ep < tp each rank holds its group's experts, and of each its slice of the width: rank r of tp = 4,
    ep = 2 has experts [4 (r // 2), 4 (r // 2) + 4) and slice r % 2 of their gate rows, up rows and down columns."""
    fmt = "dummy" if name == "dummy" else "auto"
    whole = _stacks(checkpoints[name], fmt, 0, 1)
    per_group, parts = 8 // ep, tp // ep
    for rank in range(tp):
        for (gate, w13, w2), (g, a, b) in zip(_stacks(checkpoints[name], fmt, rank, tp, ep), whole):
            block = slice(per_group * (rank // parts), per_group * (rank // parts + 1))
            rows, cols = sliced(a[block], b[block], rank % parts, parts)
            assert torch.equal(gate, g) and torch.equal(w13, rows) and torch.equal(w2, cols)


def test_a_stacked_checkpoint_loads_each_ranks_block(checkpoints, tmp_path):
    """transformers 5's form, ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``: each rank
    copies its block of rows (through a lazy tensor's ``narrow``, as at tp > 1)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = checkpoints["qwen3_moe"]
    state = {k: v.contiguous() for k, v in
             AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    whole = _stacks(folder, "auto", 0, 1)
    for (gate, w13, w2), (g, a, b) in zip(_stacks(tmp_path, "auto", 1, 2), whole):
        assert torch.equal(gate, g) and torch.equal(w13, a[4:]) and torch.equal(w2, b[4:])
    for (gate, w13, w2), (g, a, b) in zip(_stacks(tmp_path, "auto", 3, 4, 2), whole):  # group 1, slice 1
        rows, cols = sliced(a[4:], b[4:], 1, 2)
        assert torch.equal(gate, g) and torch.equal(w13, rows) and torch.equal(w2, cols)


# --------------------------------------------------------------------------------------- two ranks, gloo


def moe_logits(path: str, load_format: str) -> torch.Tensor:
    """On one rank (a spawned process): the logits of an MoE model, the architectures registered first."""
    register_moe_models()
    return model_logits(path, load_format, "float32", SEQUENCES)


@pytest.fixture(scope="module")
def ep2_logits(checkpoints) -> list[list[torch.Tensor]]:
    calls = [(moe_logits, (str(checkpoints[n]), "dummy" if n == "dummy" else "auto"))
             for n in ("qwen3_moe", "mixtral", "dummy")]
    return run_on_ranks(call_each, 2, calls, threads=1, ep_size=2)


@pytest.mark.parametrize("index, name", list(enumerate(["qwen3_moe", "mixtral", "dummy"])))
def test_logits_at_ep2_match_one_process(checkpoints, ep2_logits, index, name):
    torch.set_num_threads(1)
    ref = moe_logits(str(checkpoints[name]), "dummy" if name == "dummy" else "auto")
    rank0, rank1 = ep2_logits[0][index], ep2_logits[1][index]
    assert torch.equal(rank0, rank1), "every rank ends with the same (all-gathered) logits"
    assert relative_error(rank0, ref) <= 1e-5


@pytest.mark.parametrize("tp, ep", [(2, 1), (4, 2)])
def test_logits_with_sliced_experts_match_one_process(checkpoints, tp, ep):
    """ep < tp: every expert's width sliced over tp / ep ranks (at ep = 1 SGLang's default MoE tensor
    parallelism), the partial sums all-reduced."""
    torch.set_num_threads(1)
    calls = [(moe_logits, (str(checkpoints[n]), "auto")) for n in ("qwen3_moe", "mixtral")]
    got = run_on_ranks(call_each, tp, calls, threads=1, ep_size=ep)
    for index, name in enumerate(("qwen3_moe", "mixtral")):
        ref = moe_logits(str(checkpoints[name]), "auto")
        assert all(torch.equal(got[0][index], got[r][index]) for r in range(1, tp))
        assert relative_error(got[0][index], ref) <= 1e-5, name


@pytest.mark.parametrize("ep", [2, 1])
def test_llm_at_tp2_generates_the_same_tokens_as_one_process(checkpoints, ep):
    """The whole engine, rank 1 following rank 0, chunked prefill beside decode rows, experts whole on each rank
    (ep = 2) or each sliced over both (ep = 1): greedy tokens equal."""
    from minisgl_ref import LLM, SamplingParams

    torch.set_num_threads(1)
    prompts = [[3, 17, 200, 45, 9], [7] * 40, [100 + i for i in range(25)]]
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    kw = dict(device="cpu", chunked_prefill_size=16, max_prefill_tokens=32)
    path = str(checkpoints["qwen3_moe"])
    expected = LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    with LLM(path, tp_size=2, ep_size=ep, **kw) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]
    assert len({tuple(o.output_ids) for o in expected}) > 1  # not one degenerate answer for every prompt


# ------------------------------------------------------------------------- GPU: bf16, CUDA graphs, NCCL


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 512])
def test_gpu_bf16_partials_at_qwen3_30b_shape(tokens):
    """128 experts of H = 2048, I = 768, top-8, over 8 ranks: the fused kernel's partials sum to the reference."""
    from tests.test_fused_moe import BF16_TOL, make_layer as fused_layer

    x, w13, w2, weights, ids = fused_layer(tokens, 2048, 768, 128, 8, "random", torch.bfloat16, seed=tokens)
    ref = reference_experts(x, w13, w2, weights, ids).float()
    total = sum(expert_parallel_experts(fused(), r, 8, 128)(x, w13[16 * r:16 * r + 16], w2[16 * r:16 * r + 16],
                                                            weights, ids).float() for r in range(8))
    torch.testing.assert_close(total, ref, **BF16_TOL)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_of_a_ranks_partial_equals_eager():
    """The masking is elementwise on the device: captured once, the partial follows a new routing on replay."""
    from tests.test_fused_moe import make_layer as fused_layer

    x, w13, w2, weights, ids = fused_layer(64, 2048, 768, 128, 8, "random", torch.bfloat16, seed=1)
    fn = expert_parallel_experts(fused(), 1, 4, 128)
    a, b = w13[32:64].contiguous(), w2[32:64].contiguous()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(x, a, b, weights, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, a, b, weights, ids)
    x2, _, _, weights2, ids2 = fused_layer(64, 2048, 768, 128, 8, "overloaded", torch.bfloat16, seed=2)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn(x, a, b, weights, ids))


def moe_logits_on(path: str, device: str) -> torch.Tensor:
    register_moe_models()
    return model_logits(path, "dummy", "float32", SEQUENCES, device)


@pytest.mark.gpu
@pytest.mark.parametrize("ep", [2, 1])
def test_gpu_two_ranks_nccl_logits_match_one_gpu(checkpoints, ep):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path = str(checkpoints["dummy"])
    ref = moe_logits_on(path, "cuda")
    ranks = run_on_ranks(moe_logits_on, 2, path, "cuda", device="cuda", ep_size=ep)
    assert torch.equal(ranks[0], ranks[1])
    assert relative_error(ranks[0], ref) <= 1e-5
