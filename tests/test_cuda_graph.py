"""CUDA graphs for decode (chapter 08).

CPU tests run the graph runner itself with stand-in graphs (:class:`RerunGraphFactory`: a replay runs the captured
forward again on the captured batch, whose tensors are the static buffers) on a toy model, one attention layer
over a paged KV pool with :class:`TorchStaticBackend`. A replay that forgets to copy an input into the static
buffers, pads to the wrong size or returns the padding rows then gives wrong logits, here, without a GPU.

GPU tests check that a replayed graph computes exactly what the same batch computes eagerly (bitwise, for
captured sizes and for padded ones), and that a whole engine generates the same greedy tokens with graphs as
without.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn

from minisgl_ref.attention.torch_native import TorchStaticBackend
from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
from minisgl_ref.engine import cuda_graph
from minisgl_ref.engine.cuda_graph import (
    DUMMY_ROW,
    CudaGraphRunner,
    RerunGraphFactory,
    capture_batch_sizes,
    padded_batch_size,
)
from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
from minisgl_ref.layers.attention import AttentionLayer
from tests.engine_fixtures import make_engine, tiny_llm, tiny_engine_path  # noqa: F401 - fixtures


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


def test_padded_batch_size() -> None:
    sizes = [1, 2, 4, 8, 16, 24, 32]
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 32)] == [1, 2, 4, 4, 8, 8, 16, 24, 32]
    assert padded_batch_size(sizes, 33) is None


# ------------------------------------------------------------------------------- the runner on the CPU (stand-in)

VOCAB, KV_HEADS, GQA, HEAD_DIM = 61, 2, 2, 8
MAX_CONTEXT, NUM_ROWS = 40, 24


class ToyModel(nn.Module):
    """Token and position embeddings, one paged attention layer, a logits head: every input of a decode step
    (token, position, KV slot, page-table row, length) changes the logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        heads = KV_HEADS * GQA
        self.embed = nn.Embedding(VOCAB, 32)
        self.pos = nn.Embedding(MAX_CONTEXT, 32)
        self.qkv = nn.Linear(32, (heads + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.attn = AttentionLayer(0, heads, KV_HEADS, HEAD_DIM)
        self.head = nn.Linear(heads * HEAD_DIM, VOCAB)
        self.sizes = [heads * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(input_ids) + self.pos(positions)).split(self.sizes, dim=-1)
        return self.attn(q, k, v, fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()


class Toy:
    """A paged KV pool full of random keys and values and a page table whose rows (1..NUM_ROWS - 1) hold
    distinct slots; row 0 and slot 0 are left to the dummy requests, as in the engine."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.model = ToyModel().eval()
        self.pool = KVPool(1, NUM_ROWS * MAX_CONTEXT + 1, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
        self.pool.k[0].normal_(generator=gen)
        self.pool.v[0].normal_(generator=gen)
        self.table = ReqToTokenPool(NUM_ROWS, MAX_CONTEXT, "cpu")
        slots = 1 + torch.randperm(NUM_ROWS * MAX_CONTEXT, generator=gen).view(NUM_ROWS, MAX_CONTEXT)
        self.table.table.copy_(slots.int())
        self.table.table[0] = 0
        self.rng = random.Random(2)

    def backend(self) -> TorchStaticBackend:
        return TorchStaticBackend(self.pool, self.table)

    def decode_batch(self, bs: int, backend: TorchStaticBackend) -> ForwardBatch:
        """``bs`` requests on distinct page-table rows, each decoding its token at a random position."""
        rows = self.rng.sample(range(1, NUM_ROWS), bs)
        prefix = [self.rng.randrange(0, MAX_CONTEXT - 1) for _ in rows]
        ids = [self.rng.randrange(1, VOCAB) for _ in rows]
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=torch.tensor(ids), positions=torch.tensor(prefix),
            extend_lens_cpu=[1] * bs, prefix_lens_cpu=prefix, attn_backend=backend,
            req_pool_indices=torch.tensor(rows), out_cache_loc=self.table.table[rows, prefix].long(),
            seq_lens=torch.tensor(prefix, dtype=torch.int32) + 1,
        )  # fmt: skip

    @torch.inference_mode()
    def eager(self, fb: ForwardBatch) -> torch.Tensor:
        """The same step without graphs, on a fresh backend over the same pool."""
        backend = self.backend()
        fb = ForwardBatch(**{**fb.__dict__, "attn_backend": backend})
        backend.init_forward_metadata(fb)
        return self.model.compute_logits(self.model(fb.input_ids, fb.positions, fb))

    def runner(self, max_bs: int, backend: TorchStaticBackend | None = None) -> CudaGraphRunner:
        return CudaGraphRunner(self.model, backend or self.backend(), torch.device("cpu"), max_bs,
                               graph_factory=RerunGraphFactory())  # fmt: skip


class RecordingBackend(TorchStaticBackend):
    """Adds its capture hook to the stand-in factory's log, to check the order of a capture."""

    log: list[tuple[str, int]]

    def prepare_capture(self, batch: ForwardBatch) -> None:
        self.log.append(("prepare_capture", batch.batch_size))
        super().prepare_capture(batch)


@pytest.mark.task("8.1")
def test_capture_prepares_warms_up_then_records_each_size_largest_first() -> None:
    toy = Toy()
    backend = RecordingBackend(toy.pool, toy.table)
    factory = RerunGraphFactory()
    backend.log = factory.log
    runner = CudaGraphRunner(toy.model, backend, torch.device("cpu"), 8, graph_factory=factory)
    assert runner.batch_sizes == [1, 2, 4, 8]
    captured = [bs for what, bs in factory.log if what == "capture"]
    assert captured == [8, 4, 2, 1], "one graph per size, the largest first (the smaller ones reuse its pool)"
    for bs in captured:
        steps = [what for what, size in factory.log if size == bs]
        assert steps[0] == "prepare_capture", f"bs={bs}: the backend's metadata must point at its buffers first"
        assert steps[-1] == "capture" and "warm_up" in steps[1:-1], f"bs={bs}: warm up before capturing: {steps}"
    assert sorted(runner.graphs) == sorted(runner.outputs) == [1, 2, 4, 8]
    assert all(runner.outputs[bs].shape == (bs, VOCAB) for bs in runner.batch_sizes)


@pytest.mark.task("8.1")
def test_captured_graphs_read_the_static_buffers() -> None:
    """Fill the static buffers by hand with a real batch, refill the backend's metadata, replay the graph of that
    size: its captured output must now hold the batch's logits. A graph recorded on tensors other than the
    static buffers would replay the dummy batch of capture time."""
    toy = Toy()
    backend = toy.backend()
    runner = toy.runner(8, backend)
    for bs in (8, 2, 4, 1):
        fb = toy.decode_batch(bs, backend)
        for name in DUMMY_ROW:
            runner.static[name][:bs].copy_(getattr(fb, name))
        backend.prepare_replay(runner._static_batch(fb.prefix_lens_cpu))
        runner.graphs[bs].replay()
        torch.testing.assert_close(runner.outputs[bs], toy.eager(fb), rtol=1e-5, atol=1e-5)


@pytest.fixture
def reference_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference ladder and capture, so that the replay is graded on its own (without task 8.1)."""

    def capture(self: CudaGraphRunner) -> None:
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch([0] * bs)
            self.backend.prepare_capture(fb)
            self.graph_factory.warm_up(self._forward, fb)
            self.graphs[bs], self.outputs[bs] = self.graph_factory.capture(self._forward, fb)

    ladder = {8: [1, 2, 4, 8]}
    monkeypatch.setattr(cuda_graph, "capture_batch_sizes", lambda max_bs: ladder[max_bs])
    monkeypatch.setattr(CudaGraphRunner, "capture", capture)


@pytest.mark.task("8.2")
def test_replay_matches_eager(reference_capture: None) -> None:
    """Batches of several sizes, captured and padded, in an order where a smaller batch follows a larger one:
    each replay returns exactly its real rows' logits, as a view of the graph's output, after one replay of the
    right graph."""
    toy = Toy()
    backend = toy.backend()
    runner = toy.runner(8, backend)
    for bs in (8, 3, 5, 1, 2, 6, 4):
        fb = toy.decode_batch(bs, backend)
        padded = padded_batch_size(runner.batch_sizes, bs)
        replays = {size: graph.replays for size, graph in runner.graphs.items()}
        with torch.inference_mode():
            out = runner.replay(fb)
        assert out.shape == (bs, VOCAB), f"bs={bs}: return the real rows only, not the {padded} padded ones"
        assert out.data_ptr() == runner.outputs[padded].data_ptr(), "a view of the captured output, not a copy"
        assert {s: g.replays - replays[s] for s, g in runner.graphs.items()} == {
            s: int(s == padded) for s in runner.graphs
        }, f"bs={bs}: one replay of the graph for {padded}"
        torch.testing.assert_close(out, toy.eager(fb), rtol=1e-5, atol=1e-5)


@pytest.mark.task("8.2")
def test_replay_refills_the_padding_rows(reference_capture: None) -> None:
    """After a batch of 8, a batch of 5 runs in the graph for 8: rows 5-7 of every static input must be the dummy
    request again (token 0, position 0, slot 0, page-table row 0, length 1), not what the batch of 8 left."""
    toy = Toy()
    backend = toy.backend()
    runner = toy.runner(8, backend)
    with torch.inference_mode():
        runner.replay(toy.decode_batch(8, backend))
        fb = toy.decode_batch(5, backend)
        runner.replay(fb)
    for name, value in DUMMY_ROW.items():
        assert runner.static[name][:5].tolist() == getattr(fb, name).tolist(), name
        assert runner.static[name][5:].tolist() == [value] * 3, f"{name}: padding rows hold {runner.static[name]}"


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
    except (ImportError, RuntimeError, ValueError) as exc:  # ValueError: the package is not installed
        pytest.skip(f"{backend} unavailable: {exc}")
    runner = llm.engine.runner
    graphs = next(g for g in runner.graph_runners
                  if isinstance(g, CudaGraphRunner) and g.backend is runner.attn_backend)  # fmt: skip
    assert graphs.batch_sizes == [1, 2, 4, 8, 16]
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
        assert any(isinstance(g, CudaGraphRunner) for g in llm.engine.runner.graph_runners) == graphs
        outs[graphs] = [o.output_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
    assert [len(o) for o in outs[True]] == [p.max_new_tokens for p in params]


def test_release_graphs_drops_every_graph_runner(tiny_llm) -> None:
    """A tensor-parallel rank calls ``release_graphs`` before it destroys its NCCL communicator, whose teardown
    waits until no CUDA graph holds the all-reduces it captured (chapter 09): a graph runner the method forgot
    would hang every tensor-parallel shutdown. The runner holds its graph runners in one list, and nothing of it
    may still refer to one afterwards."""
    runner = make_engine(tiny_llm).runner
    held = [object(), object(), object()]  # stand-ins for the decode, a second decode and the extend graph runners
    runner.graph_runners = list(held)
    runner.release_graphs()
    assert runner.graph_runners == []
    values = [x for v in vars(runner).values() for x in (v if isinstance(v, (list, tuple)) else [v])]
    assert not [x for x in values if any(x is h for h in held)]


def test_decode_graphs_replay_only_steps_on_the_backend_they_captured() -> None:
    """An engine may capture one set of decode graphs per decode backend (the attention planner's, chapter 11):
    a set replays only the steps whose ``fb.attn_backend`` is its own, so a step the planner sends to another
    backend is never replayed with the wrong attention."""
    toy = Toy()
    backend, other = toy.backend(), toy.backend()
    runner = toy.runner(8, backend)
    assert runner.can_run(toy.decode_batch(3, backend))
    assert not runner.can_run(toy.decode_batch(3, other))
    extend = toy.decode_batch(2, backend)
    extend.mode = ForwardMode.EXTEND
    assert not runner.can_run(extend)
