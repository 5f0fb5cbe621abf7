"""Chapter 14: the routing counter (SGLang's expert distribution record) counts what the router really picked, only
for real tokens, only while recording, and the same in CUDA graphs as outside them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.moe.distribution import ExpertDistribution
from minisgl_ref.moe.layer import MoEBlock
from tests.test_models import PROMPTS
from tests.test_moe_models import moe_checkpoints  # noqa: F401  (the fixture)


def batch_writing(slots: list[int]) -> ForwardBatch:
    """A batch whose only field the counter reads, ``out_cache_loc``, is ``slots``."""
    fb = ForwardBatch.__new__(ForwardBatch)
    fb.out_cache_loc = torch.tensor(slots)
    return fb


def test_the_counts_of_a_hand_made_routing():
    dist = ExpertDistribution([1, 3], num_experts=4, top_k=2, device=torch.device("cpu"))
    ids = torch.tensor([[0, 1], [1, 2], [0, 1]])  # three rows; the last one is padding (writes slot 0)
    dist.begin_step(batch_writing([5, 6, 0]), 3)
    dist.record(0, ids)
    assert dist.dump()["steps"] == 0 and not dist.pairs.any()  # not recording yet
    dist.start()
    dist.begin_step(batch_writing([5, 6, 0]), 3)
    dist.record(0, ids)
    dist.record(1, torch.tensor([[3, 2], [3, 2], [0, 1]]))
    dist.begin_step(batch_writing([7]), 1)
    dist.record(0, torch.tensor([[3, 0]]))
    dist.record(1, torch.tensor([[3, 0]]))
    got = dist.dump()
    assert got["steps"] == 2 and got["tokens"] == 3
    assert got["pairs"] == [[2, 2, 1, 1], [1, 0, 2, 3]]
    assert got["active_expert_steps"] == [3 + 2, 2 + 2]  # distinct experts of each step, padding left out
    assert got["active_experts_per_step"] == [2.5, 2.0]
    dist.stop()
    dist.begin_step(batch_writing([8]), 1)
    dist.record(0, torch.tensor([[1, 2]]))
    assert dist.dump()["pairs"] == got["pairs"]  # stopped: unchanged
    dist.start()
    assert dist.dump()["steps"] == 0 and not dist.pairs.any()


def count_by_hooks(llm: LLM) -> tuple[dict[str, int], list[list[int]], list[int]]:
    """An independent count: hooks on every router (``gate``) see its logits, and the top-k of them is the choice."""
    blocks = [m for m in llm.model.modules() if isinstance(m, MoEBlock)]
    pairs = [[0] * b.num_experts for b in blocks]
    active = [0] * len(blocks)
    totals = {"steps": 0, "tokens": 0}

    def hook(index: int):  # type: ignore[no-untyped-def]
        def seen(_module, _inputs, logits):  # type: ignore[no-untyped-def]
            ids = torch.topk(logits.float(), blocks[index].top_k, dim=-1).indices.reshape(-1)
            counts = torch.bincount(ids, minlength=blocks[index].num_experts).tolist()
            pairs[index] = [a + b for a, b in zip(pairs[index], counts)]
            active[index] += sum(c > 0 for c in counts)
            if index == 0:
                totals["steps"] += 1
                totals["tokens"] += logits.shape[0]
        return seen

    handles = [b.gate.register_forward_hook(hook(i)) for i, b in enumerate(blocks)]
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True), use_tqdm=False)
    for h in handles:
        h.remove()
    return totals, pairs, active


def test_the_engine_counts_what_the_routers_chose(moe_checkpoints):  # noqa: F811
    llm = LLM(moe_checkpoints["qwen3_moe_mixed"], device="cpu", dtype="float32", attention_backend="torch_native",
              max_total_tokens=2048, disable_radix_cache=True, enable_expert_distribution_metrics=True)
    llm.start_expert_distribution_record()
    totals, pairs, active = count_by_hooks(llm)
    llm.stop_expert_distribution_record()
    got = llm.dump_expert_distribution_record()
    assert got["layer_ids"] == [1, 3] and got["top_k"] == 2
    assert got["steps"] == totals["steps"] and got["tokens"] == totals["tokens"]
    assert got["tokens"] == sum(len(p) for p in PROMPTS) + len(PROMPTS) * 5  # every prompt token, 5 fed outputs
    assert got["pairs"] == pairs and got["active_expert_steps"] == active
    assert all(sum(row) == 2 * got["tokens"] for row in got["pairs"])
    llm.shutdown()


def test_counting_is_asked_for_and_needs_experts(moe_checkpoints, tmp_path):  # noqa: F811
    llm = LLM(moe_checkpoints["mixtral"], device="cpu", dtype="float32", max_total_tokens=1024)
    with pytest.raises(ValueError, match="enable_expert_distribution_metrics=True"):
        llm.start_expert_distribution_record()
    llm.shutdown()
    with pytest.raises(ValueError, match="enable_expert_distribution_metrics needs a mixture-of-experts model"):
        LLM(moe_checkpoints["mistral_window"], device="cpu", dtype="float32", max_total_tokens=1024,
            enable_expert_distribution_metrics=True)


@pytest.mark.gpu
def test_in_cuda_graphs_padding_rows_are_not_counted(moe_checkpoints):  # noqa: F811
    """Decode steps replay graphs padded with dummy rows (three requests run in the graph of four, say); the
    counter sees the same tokens and steps as the hooks of an eager engine, and every token's k picks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    got = {}
    for graphs in (True, False):
        llm = LLM(moe_checkpoints["qwen3_moe_mixed"], device="cuda", dtype="float32", max_total_tokens=4096,
                  disable_radix_cache=True, disable_cuda_graph=not graphs, enable_expert_distribution_metrics=True)
        llm.start_expert_distribution_record()
        llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True), use_tqdm=False)
        got[graphs] = llm.dump_expert_distribution_record()
        llm.shutdown()
    assert got[True]["tokens"] == got[False]["tokens"] == sum(len(p) for p in PROMPTS[:3]) + 3 * 5
    assert got[True]["steps"] == got[False]["steps"]
    assert all(sum(row) == 2 * got[True]["tokens"] for row in got[True]["pairs"])
    assert got[True]["pairs"] == got[False]["pairs"]  # float32: the same routing in and out of graphs


# ------------------------------------------------------------------------------------------- the routed floor


def test_the_routed_floor_of_every_expert_is_chapter_11s_floor():
    """If every step read every expert, the routed floor would be chapter 11's floor of as many steps; each expert
    a step leaves unread takes exactly one expert's bytes off it."""
    from minisgl_ref.bench.offline import roofline_floor_seconds, routed_floor_seconds, weight_bytes
    from minisgl_ref.models import ModelConfig
    from minisgl_ref.models.loader import SHIPPED_CONFIGS

    config = dataclasses.replace(ModelConfig.from_file(SHIPPED_CONFIGS / "qwen3-30b-a3b.json"), dtype=torch.bfloat16)
    layers, experts, steps = config.num_layers, 128, 40
    prompt_lens, output_lens = [100, 7], [steps, 25]
    context = sum(o * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens))
    full = {"layer_ids": list(range(layers)), "steps": steps, "active_expert_steps": [steps * experts] * layers}
    bw = 4.0e12
    assert routed_floor_seconds(config, full, context, bw) == pytest.approx(
        roofline_floor_seconds(prompt_lens, output_lens, weight_bytes(config), config.kv_bytes_per_token, bw))
    sparse = full | {"active_expert_steps": [steps * 8] * layers}  # batch 1: k = 8 experts per layer and step
    expert_bytes = 3 * config.hidden_size * 768 * 2
    saved = layers * steps * (experts - 8) * expert_bytes / bw
    assert routed_floor_seconds(config, full, context, bw) - routed_floor_seconds(config, sparse, context, bw) \
        == pytest.approx(saved)
    # Qwen3-30B-A3B reads ~3.3 B parameters per token at batch 1 (the "A3B"), not 30.5 B.
    per_step = (routed_floor_seconds(config, sparse, 0, bw) * bw) / steps / 2
    assert 3.0e9 < per_step < 3.6e9


def test_the_bench_reports_the_routing_of_the_timed_run(moe_checkpoints):  # noqa: F811
    from minisgl_ref.bench.offline import ModelSpec, run_stage
    from minisgl_ref.bench.workloads import canonical_workload

    workload = canonical_workload(num_prompts=3, input_len=(8, 16), output_len=(4, 6))
    workload = dataclasses.replace(workload, prompts=[[t % 320 for t in p] for p in workload.prompts])  # tiny vocab
    spec = ModelSpec(str(moe_checkpoints["qwen3_moe"]), dtype="float32", device="cpu")
    result = run_stage("custom", workload, spec, {"enable_expert_distribution_metrics": True,
                                                   "attention_backend": "torch_native", "max_total_tokens": 1024})
    d = result.expert_distribution
    assert d is not None and d["layer_ids"] == [0, 1]
    # The timed run only (no warm-up on a CPU): every prompt token and every output token but each last one.
    assert d["tokens"] == result.input_tokens + result.output_tokens - result.requests
    assert d["steps"] == result.steps
    assert result.routed_floor_s is None  # the floor is for GPUs (a bandwidth), as chapter 11's
