"""CUDA graphs for decode (chapter 08).

CPU tests cover the padding arithmetic. GPU tests check that a replayed graph computes exactly what the same
batch computes eagerly (bitwise, for captured sizes and for padded ones), and that a whole engine generates the
same greedy tokens with graphs as without.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
from minisgl_ref.engine.cuda_graph import capture_batch_sizes, padded_batch_size


@pytest.mark.task("8.1")
def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_batch_sizes(0)


@pytest.mark.task("8.1")
def test_padded_batch_size() -> None:
    sizes = capture_batch_sizes(32)
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 24, 32]
    assert padded_batch_size(sizes, 33) is None


def test_config_rejects_bad_graph_size() -> None:
    from minisgl_ref.core.config import EngineConfig

    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=0)


# ------------------------------------------------------------------------------------------------------- GPU

SMALL_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 2048, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def small_qwen3(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("small_qwen3")
    (folder / "config.json").write_text(json.dumps(SMALL_QWEN3))
    return folder


def _llm(path, dtype: str, **kw):  # type: ignore[no-untyped-def]
    from minisgl_ref.llm import LLM

    return LLM(path, load_format="dummy", dtype=dtype, device="cuda", max_total_tokens=32768,
               disable_overlap_schedule=True, **kw)


def _decode_batch(llm, bs: int, seed: int):  # type: ignore[no-untyped-def]
    """Prefill ``bs`` requests of random lengths through the engine, then schedule (not run) their decode."""
    rng = random.Random(seed)
    engine = llm.engine
    for _ in range(bs):
        prompt = [rng.randrange(2048) for _ in range(rng.randrange(1, 300))]
        engine.add_request(llm.make_request(prompt, _greedy(8)))
    while engine.scheduler.waiting or engine.scheduler.chunked:
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch is not None and batch.is_decode and len(batch.reqs) == bs
    return batch


def _greedy(n: int):  # type: ignore[no-untyped-def]
    from minisgl_ref import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _pad(fb: ForwardBatch, bs: int) -> ForwardBatch:
    """The same decode batch with padding rows exactly as the graph runner builds them."""
    pad = bs - fb.batch_size

    def cat(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.zeros(pad, dtype=t.dtype, device=t.device)])

    return ForwardBatch(ForwardMode.DECODE, cat(fb.input_ids), cat(fb.positions), [1] * bs,
                        fb.prefix_lens_cpu + [0] * pad, fb.attn_backend, cat(fb.req_pool_indices),
                        cat(fb.out_cache_loc))


def _eager_logits(runner, fb: ForwardBatch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(fb)
        return runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb))


@pytest.mark.gpu
@pytest.mark.task("8.2")
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_replay_is_bitwise_eager(small_qwen3, backend: str) -> None:
    """Replay == eager on the same (padded) batch, bit for bit; and close to the unpadded eager batch."""
    try:
        llm = _llm(small_qwen3, "bfloat16", cuda_graph_max_bs=16, attention_backend=backend)
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"{backend} unavailable: {exc}")
    runner = llm.engine.runner
    graphs = runner.graph_runner
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8, 16]
    for i, bs in enumerate([1, 3, 8, 13, 16]):
        batch = _decode_batch(llm, bs, seed=i)
        fb = runner.prepare(batch)
        padded = padded_batch_size(graphs.batch_sizes, bs)
        assert padded is not None
        with torch.inference_mode():
            replayed = graphs.replay(fb).clone()
        eager_padded = _eager_logits(runner, _pad(fb, padded))[:bs]
        assert replayed.shape == (bs, SMALL_QWEN3["vocab_size"])
        assert torch.equal(replayed, eager_padded), f"bs={bs}: replay differs from eager at padded size {padded}"
        eager = _eager_logits(runner, fb)
        rel = float((replayed.double() - eager.double()).norm() / eager.double().norm())
        assert rel < 2e-2, f"bs={bs}: padded replay vs unpadded eager rel. error {rel}"
        # finish these requests so the next batch size starts from an empty engine
        for req in batch.reqs:
            llm.engine.abort(req)
        while llm.engine.has_work:
            llm.engine.step()


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_engine_graphs_match_eager(small_qwen3, overlap: bool) -> None:
    """Greedy generation with CUDA graphs == without (float32 and the triton backend: no near-ties from bf16)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(2048) for _ in range(rng.randrange(1, 200))] for _ in range(37)]
    params = [_greedy(rng.randrange(1, 40)) for _ in prompts]
    outs = {}
    for graphs in (True, False):
        llm = _llm(small_qwen3, "float32", attention_backend="triton", cuda_graph_max_bs=24,
                   disable_cuda_graph=not graphs)
        llm.engine.overlap = overlap
        assert (llm.engine.runner.graph_runner is not None) == graphs
        outs[graphs] = [o.output_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
    assert [len(o) for o in outs[True]] == [p.max_new_tokens for p in params]
