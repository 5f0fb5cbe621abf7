"""Chapter 11: the benchmark workloads, the roofline, the stage ladder and ``python -m minisgl_ref bench offline``.

Everything here runs on CPU in well under a minute: the engine runs use the ``--quick`` presets (a tiny random
Qwen3-shaped model and CPU-sized workloads).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl_ref.bench import offline
from minisgl_ref.bench.provenance import collect_provenance, command_line, git_commit
from minisgl_ref.bench.workloads import CANONICAL_OUTPUT_TOKENS, canonical_workload, shared_prefix_workload
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.loader import SHIPPED_CONFIGS

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_thread():
    """Timed engine runs use one CPU thread: the test machine's cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------- workloads


def test_decode_balance_stages_are_the_workloads_running_contexts():
    """``benchmarks/decode_balance.py`` rebuilds decode steps of the canonical workload: at its first stage every
    request runs with its prompt and one new token; later stages keep exactly the requests whose output is not
    done, each one token longer per step; each equal-length control has as many requests and (to rounding) tokens."""
    from benchmarks.decode_balance import canonical_stages

    work = canonical_workload()
    prompts = [len(p) for p in work.prompts]
    outputs = [sp["max_new_tokens"] for sp in work.sampling_params]
    stages = canonical_stages((256, 64), uniform=True)
    assert stages["256"] == [p + 1 for p in prompts]
    steps = [t for t in range(max(outputs)) if stages["64"] == [p + t + 1 for p, o in zip(prompts, outputs) if o > t]]
    assert steps, "the 64 stage is no step of the workload"
    assert sum(o > steps[0] for o in outputs) <= 64 < sum(o > steps[0] - 1 for o in outputs)  # the first such step
    for mark in ("256", "64"):
        control = stages[f"{mark}-uniform"]
        assert len(control) == len(stages[mark]) and len(set(control)) == 1
        assert 0 <= sum(stages[mark]) - sum(control) < len(control)


def test_decode_matmuls_weight_stream_kernel_multiplies_and_tiles_fit():
    """``benchmarks/decode_matmuls.py``'s Triton kernel (through Triton's interpreter on a CPU, in float32: the
    interpreter mishandles bf16 inputs) computes ``x @ w.T`` for row counts below and at its block, and every tile
    it may try divides the Qwen3-0.6B weight shapes it is timed on, or is skipped for that shape."""
    import benchmarks.decode_matmuls as dm

    if type(__import__("triton").language.cdiv).__name__ == "JITFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, 16):
        x = torch.randn(rows, 256, generator=g)
        w = torch.randn(64, 256, generator=g)
        out = torch.zeros(rows, 64, dtype=torch.bfloat16)
        dm.triton_linear(x, w, out, (16, 128, 3))
        ref = x @ w.T
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    shapes = [(dm.Q + 2 * dm.KV, dm.HIDDEN), (dm.HIDDEN, dm.Q), (2 * dm.FFN, dm.HIDDEN), (dm.HIDDEN, dm.FFN),
              (dm.VOCAB, dm.HIDDEN)]
    for n, k in shapes:
        assert any(n % bn == 0 and k % bk == 0 for bn, bk, _ in dm.TILES), (n, k)


def test_skinny_gemm_split_k_adds_every_slice_once_and_resets_its_counters():
    """``benchmarks/skinny_gemm.py`` (Triton's interpreter, float32): with K cut into slices, the last program to
    reach a tile adds all the partial sums, for row counts below, at and above one row block, and leaves every
    counter at zero so that the next call (a CUDA graph replays the same workspace) starts clean; a config that
    does not tile the weight is refused with the shapes named, and every config the GPU benchmark may pick tiles
    at least one Qwen3-0.6B layer shape."""
    import benchmarks.decode_matmuls as dm
    from benchmarks.decode_matmuls_pdl import CONFIGS
    from benchmarks.skinny_gemm import Workspace, skinny_linear

    if type(__import__("triton").language.cdiv).__name__ == "JITFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    g = torch.Generator().manual_seed(0)
    ws = Workspace(torch.device("cpu"), floats=1 << 18, tiles=256)
    for rows in (1, 16, 70):
        for (n, k), config in (((128, 512), (32, 64, 4, 3)), ((96, 384), (32, 64, 2, 3)), ((64, 256), (64, 64, 1, 3))):
            x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
            out = torch.zeros(rows, n)
            for _ in range(2):  # the second call reuses the counters the first one left
                out.zero_()
                skinny_linear(x, w, out, ws, config)
                ref = x @ w.T
                assert ((out - ref).norm() / ref.norm()).item() < 1e-5, (rows, n, k, config)
            assert int(ws.count.abs().sum()) == 0
    with pytest.raises(ValueError, match="does not tile a 96x384"):
        skinny_linear(torch.zeros(1, 384), torch.zeros(96, 384), torch.zeros(1, 96), ws, (64, 64, 2, 3))
    shapes = [(dm.Q + 2 * dm.KV, dm.HIDDEN), (dm.HIDDEN, dm.Q), (2 * dm.FFN, dm.HIDDEN), (dm.HIDDEN, dm.FFN)]
    for bn, bk, split, _ in CONFIGS:
        assert any(n % bn == 0 and k % (split * bk) == 0 for n, k in shapes), (bn, bk, split)


def test_padded_model_computes_what_the_small_model_computes():
    """``scripts/gpu/measure/padded_model.py`` widens a Llama model with zeros (more hidden units, heads with their own KV
    heads, a wider MLP, rescaled norms): the wide model's logits are the small one's, in float32, for a tiny
    random grouped-query model checked with HF transformers."""
    import importlib.util

    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("padded_model", REPO / "scripts" / "gpu" / "measure" / "padded_model.py")
    assert spec is not None and spec.loader is not None
    pm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pm)
    small_cfg = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                     num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    small = LlamaForCausalLM(LlamaConfig(**small_cfg)).float().eval()
    for param in small.parameters():  # norm weights away from 1, so that their rescaling is checked
        torch.nn.init.normal_(param, mean=0.5 if param.dim() == 1 else 0.0, std=0.3)
    state = {k: v for k, v in small.state_dict().items() if k != "lm_head.weight"}
    wide_state = pm.padded_state(state, small_cfg, hidden=96, heads=12, inter=200, dtype=torch.float32)
    wide_cfg = dict(small_cfg, hidden_size=96, num_attention_heads=12, num_key_value_heads=12, intermediate_size=200,
                    rms_norm_eps=1e-5 * 48 / 96)
    wide = LlamaForCausalLM(LlamaConfig(**wide_cfg)).float().eval()
    missing, unexpected = wide.load_state_dict(wide_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    wide.tie_weights()
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = small(ids).logits, wide(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert want.std() > 0.1  # the model is not trivially constant


def test_decode_balance_chunks_merge_back_to_plain_attention(monkeypatch):
    """The ``fi_chunkN`` variant of ``benchmarks/decode_balance.py`` cuts contexts into pieces, runs each piece as a
    request of its own and merges the pieces by log-sum-exp. Its bookkeeping (which piece belongs to which request,
    the padding state of weight 0) is checked here on a CPU, with plain-PyTorch stand-ins for FlashInfer's two
    calls: the merged result must equal one piece per request."""
    import types

    import benchmarks.decode_balance as db

    class Wrapper:  # plain attention over each "request" of the plan, with its natural-log LSE
        def __init__(self, *args, **kw) -> None:
            pass

        def plan(self, indptr, indices, last_page_len, heads, kv_heads, head_dim, page_size, **kw) -> None:
            self.indptr, self.indices, self.group = indptr.tolist(), indices.long(), heads // kv_heads

        def run(self, q, cache, return_lse=False):
            k, v = (c[:, 0].float().repeat_interleave(self.group, 1) for c in cache)
            outs, lses = [], []
            for j in range(len(self.indptr) - 1):
                slots = self.indices[self.indptr[j] : self.indptr[j + 1]]
                scores = torch.einsum("hd,nhd->hn", q[j].float(), k[slots]) * db.HEAD_DIM**-0.5
                lses.append(torch.logsumexp(scores, 1))
                outs.append(torch.einsum("hn,nhd->hd", scores.softmax(1), v[slots]))
            return torch.stack(outs).to(q.dtype), torch.stack(lses)

    def merge_states(o, lse):
        return (torch.softmax(lse, 1)[..., None] * o.float()).sum(1).to(o.dtype), torch.logsumexp(lse, 1)

    monkeypatch.setattr(db, "DEVICE", "cpu")
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=Wrapper, merge_states=merge_states))  # fmt: skip
    stage = db.Stage([300, 17, 129, 256, 1])
    chunked, order = db.chunked_runner(stage, 128)
    whole, _ = db.chunked_runner(stage, 10_000)  # one piece per request
    assert order == list(range(5))
    torch.testing.assert_close(chunked().float(), whole().float(), rtol=0, atol=2e-2)


@pytest.mark.parametrize("kind", ["chunk", "chunk_even_sorted", "fixed_0", "fixed_25", "fixed_many"])
def test_split_decode_plans_cover_every_token_once_and_merge_back(kind):
    """The CUDA split-KV kernel (``minisgl_ref/perf/cuda/split_decode.cu``) reads each plan piece (request, first
    index, end index, result row), and the last piece of a request merges rows ``first .. first + parts - 1``.
    Here the same arithmetic in plain PyTorch over every plan shape the benchmark uses: every token lies in
    exactly one piece of its own request, a request's rows are its pieces, and merging them gives plain
    attention."""
    from benchmarks.split_decode import plan

    lens = [300, 17, 129, 256, 1, 2048]
    p = {"chunk": lambda: plan(lens, 128, "cpu"), "chunk_even_sorted": lambda: plan(lens, 100, "cpu", True, True),
         "fixed_0": lambda: plan(lens, 1, "cpu", fixed=0.0), "fixed_25": lambda: plan(lens, 1, "cpu", fixed=0.25),
         "fixed_many": lambda: plan([2, 1], 1, "cpu", fixed=3.0)}[kind]()  # more pieces than tokens: empty ones
    lens = [2, 1] if kind == "fixed_many" else lens
    items, parts, first = p["items"].tolist(), p["req_parts"].tolist(), p["req_first_item"].tolist()
    offsets = [sum(lens[:r]) for r in range(len(lens) + 1)]
    covered = sorted(t for r, a, b, _ in items for t in range(a, b))
    assert covered == list(range(offsets[-1]))  # every token once
    assert all(offsets[r] <= a <= b <= offsets[r + 1] for r, a, b, _ in items if b > a)
    assert kind != "fixed_25" or len(items) == int(len(lens) * 1.25)
    torch.manual_seed(0)
    q, k, v = torch.randn(len(lens), 4), torch.randn(offsets[-1], 4), torch.randn(offsets[-1], 4)
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for r, a, b, row in items:
        if b > a:
            scores = k[a:b] @ q[r]
            rows[row] = (torch.logsumexp(scores, 0), scores.softmax(0) @ v[a:b])
    for r in range(len(lens)):
        pieces = [rows[first[r] + j] for j in range(parts[r])]  # the merge reads exactly these rows
        assert sum(1 for it in items if it[0] == r and it[2] > it[1]) == parts[r]
        lse = torch.stack([x for x, _ in pieces])
        merged = (torch.softmax(lse, 0)[:, None] * torch.stack([o for _, o in pieces])).sum(0)
        scores = k[offsets[r] : offsets[r + 1]] @ q[r]
        torch.testing.assert_close(merged, scores.softmax(0) @ v[offsets[r] : offsets[r + 1]])


def test_overlap_decode_halves_split_rows_and_tokens_evenly():
    """``benchmarks/overlap_decode.py`` runs a decode step as two halves whose attention calls take turns: each row
    lands in exactly one half, the halves differ by at most one row, and their context tokens by at most the
    longest context (so neither half's attention is much longer than the other's)."""
    import random

    from benchmarks.overlap_decode import split_balanced

    rng = random.Random(3)
    for n in (1, 2, 7, 64, 256):
        lens = [rng.randint(1, 2000) for _ in range(n)]
        a, b = split_balanced(lens)
        assert sorted(a + b) == list(range(n)) and abs(len(a) - len(b)) <= 1
        assert abs(sum(lens[i] for i in a) - sum(lens[i] for i in b)) <= max(lens)
    assert split_balanced([1000, 10, 10, 10]) == ([0, 3], [1, 2])  # the long one cannot be balanced by count


def test_benchmarks_page_is_what_the_result_files_say():
    """docs/benchmarks.md is written by scripts/benchmarks_page.py from docs/data/: a result file added or changed
    without regenerating the page leaves the site showing old numbers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmarks_page", REPO / "scripts" / "benchmarks_page.py")
    assert spec is not None and spec.loader is not None
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    assert page.render() == (REPO / "docs" / "benchmarks.md").read_text(), "run python scripts/benchmarks_page.py"
    for listed in re.findall(r"`docs/data/([^`]+)`", page.render()):
        assert (REPO / "docs" / "data" / listed).is_file(), listed


@pytest.mark.task("11.1")
def test_canonical_workload_totals_133966_output_tokens():
    wl = canonical_workload()
    assert wl.num_requests == 256
    assert wl.output_tokens == CANONICAL_OUTPUT_TOKENS == 133_966
    assert sum(p["max_new_tokens"] for p in wl.sampling_params) == 133_966
    assert all(100 <= len(p) <= 1024 for p in wl.prompts)
    assert all(0 <= t <= 10_000 for p in wl.prompts for t in p)
    assert wl.input_tokens == 142_827  # a second fingerprint: drawing in another order changes both totals
    assert all(p == {"max_new_tokens": p["max_new_tokens"], "temperature": 0.6, "ignore_eos": True}
               for p in wl.sampling_params)


@pytest.mark.task("11.1")
def test_canonical_workload_draws_all_prompts_before_all_lengths():
    """Interleaving the draws (prompt, then its max_tokens) is a different workload; ours is not that one."""
    import random

    random.seed(0)
    interleaved = []
    for _ in range(256):
        prompt = [random.randint(0, 10_000) for _ in range(random.randint(100, 1024))]
        interleaved.append((prompt, random.randint(100, 1024)))
    assert sum(m for _, m in interleaved) != canonical_workload().output_tokens


@pytest.mark.task("11.1")
def test_a_small_canonical_workload_follows_the_recipe():
    """The same recipe at any size: the seed, inclusive bounds, every prompt before every output length, the
    temperature and the spec as given; and the global generator is left where the published scripts leave it."""
    import random

    wl = canonical_workload(5, input_len=(3, 6), output_len=(40, 50), temperature=0.25, seed=7)
    after = random.random()
    random.seed(7)
    prompts = [[random.randint(0, 10_000) for _ in range(random.randint(3, 6))] for _ in range(5)]
    lengths = [random.randint(40, 50) for _ in range(5)]
    assert random.random() == after, "canonical_workload must draw from the global generator, seeded, and only that"
    assert wl.name == "canonical" and wl.prompts == prompts
    assert wl.sampling_params == [{"max_new_tokens": n, "temperature": 0.25, "ignore_eos": True} for n in lengths]
    assert wl.spec == {"num_prompts": 5, "input_len": [3, 6], "output_len": [40, 50], "temperature": 0.25,
                       "ignore_eos": True, "seed": 7}


def test_shared_prefix_workload_groups_share_exactly_their_system_prompt():
    wl = shared_prefix_workload(3, 4, system_len=50, question_len=7, output_len=5, seed=1)
    assert wl.num_requests == 12
    assert all(len(p) == 57 for p in wl.prompts)
    assert wl.output_tokens == 12 * 5
    groups: dict[tuple[int, ...], list[list[int]]] = {}
    for p in wl.prompts:
        groups.setdefault(tuple(p[:50]), []).append(p)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    assert len({tuple(p[50:]) for p in wl.prompts}) == 12  # every question is its own
    assert wl.prompts == shared_prefix_workload(3, 4, 50, 7, 5, seed=1).prompts  # seeded
    labels = [tuple(p[:50]) for p in wl.prompts]
    runs = 1 + sum(a != b for a, b in zip(labels, labels[1:]))
    assert runs > 3  # shuffled, as in SGLang: a group's requests do not arrive back to back


# ------------------------------------------------------------------------------------------------ roofline


@pytest.mark.task("11.2")
def test_roofline_floor_of_the_canonical_workload():
    """The canonical workload's floor (weights + KV per decode step, over the bandwidth): 5.03 s at the 3.0 TB/s
    measured on an H100 SXM and 4.50 s at its datasheet 3.35 TB/s (about 4.6 s, ~29k output tok/s, within 3%)."""
    config = ModelConfig.from_file(SHIPPED_CONFIGS / "qwen3-0.6b.json")  # bf16
    assert config.kv_bytes_per_token == 114_688
    assert offline.weight_bytes(config) == 596_049_920 * 2  # tied embedding counted once
    wl = canonical_workload()
    measured = offline.workload_floor_seconds(wl, config, offline.H100_MEASURED_BANDWIDTH)
    datasheet = offline.workload_floor_seconds(wl, config, 3.35e12)
    assert measured == pytest.approx(5.030, abs=0.005)
    assert datasheet == pytest.approx(4.505, abs=0.005)
    assert datasheet == pytest.approx(4.6, rel=0.03)
    assert wl.output_tokens / datasheet == pytest.approx(29_700, rel=0.01)


@pytest.mark.task("11.2")
def test_weight_bytes_count_elements_times_their_size(tmp_path):
    """The quick model in float32 (4 bytes a weight), counted by hand: a tied embedding (read once, by the LM
    head), and per layer the fused Q/K/V, O, gate/up and down projections, two norms and Qwen3's q/k norms."""
    (tmp_path / "config.json").write_text(json.dumps(offline.QUICK_MODEL_CONFIG))
    config = ModelConfig.from_file(tmp_path / "config.json")
    assert config.dtype == torch.float32
    h, i, d, vocab = 256, 768, 64, 10240
    layer = (4 + 2 * 2) * d * h + h * 4 * d + 2 * i * h + i * h + 2 * h + 2 * d
    assert offline.weight_bytes(config) == (vocab * h + 2 * layer + h) * 4 == 16_783_360


@pytest.mark.task("11.2")
def test_roofline_floor_by_hand():
    # Two requests: (P=3, O=2) and (P=1, O=3). Three steps read the weights; contexts 3+4 and 1+2+3.
    floor = offline.roofline_floor_seconds([3, 1], [2, 3], weight_bytes=100, kv_bytes_per_token=10, bandwidth=10)
    assert floor == (3 * 100 + (3 + 4 + 1 + 2 + 3) * 10) / 10
    assert offline.context_token_sum([3, 1], [2, 3]) == 13
    assert offline.context_token_sum([5], [1]) == 5  # one output token reads only the prompt
    assert offline.context_token_sum([], []) == 0 and offline.roofline_floor_seconds([], [], 100, 10, 10) == 0
    # a request that runs longer than the others sets the number of steps (weights are read once per step)
    assert offline.roofline_floor_seconds([1, 1, 1], [4, 1, 1], 1000, 0, 1) == 4 * 1000


# ----------------------------------------------------------------------------------------------- the ladder


def test_each_stage_adds_one_feature():
    base = {"chunked_prefill_size": 256, "max_prefill_tokens": 1024}
    assert offline.stage_settings("naive", base) == ("naive", {})
    seen = []
    for stage in offline.STAGES[1:]:
        engine, kw = offline.stage_settings(stage, base)
        assert engine == "paged" and kw["max_prefill_tokens"] == 1024
        assert offline.stage_of(engine, kw) == stage
        seen.append((not kw["disable_radix_cache"], kw["chunked_prefill_size"] != -1,
                     not kw["disable_overlap_schedule"]))
    assert seen == [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    assert offline.stage_settings("chunked", base)[1]["chunked_prefill_size"] == 256
    assert offline.stage_of("paged", {"disable_radix_cache": True}) == "custom"  # chunked + overlap, no radix
    assert offline.parse_stages("all") == list(offline.STAGES)
    assert offline.parse_stages("paged, radix") == ["paged", "radix"]
    with pytest.raises(ValueError):
        offline.stage_settings("chunked", {"chunked_prefill_size": -1})


def test_radix_cache_computes_at_least_3x_fewer_prefill_tokens(one_thread):
    """The quick shared-prefix workload, paged KV without and with the radix cache, in one process.

    The counts are deterministic, so they are what this test checks: with the radix cache each group's system
    prompt is computed once (the in-batch check holds back same-group requests admitted together until the
    prefix is in the tree), which is >= 3x fewer prefill tokens than without it. Whether that is also faster
    is a timing question for the benchmark itself (its committed CPU run is
    docs/data/bench_offline_quick_shared_prefix_cpu.json, read by chapter 04), not for a pass/fail test."""
    wl = shared_prefix_workload(**offline.QUICK_SHARED_PREFIX)
    paged, radix = offline.run_ladder(wl, ["paged", "radix"], offline.quick_model("cpu"),
                                      dict(offline.QUICK_BUDGETS))
    for r in (paged, radix):
        assert r.requests == wl.num_requests and r.output_tokens == wl.output_tokens and r.aborted == 0
        assert r.retractions == 0
    assert paged.prefill_tokens == wl.input_tokens and paged.cached_tokens == 0
    assert paged.radix_hit_rate is None
    assert radix.prefill_tokens + radix.cached_tokens == wl.input_tokens
    assert paged.prefill_tokens >= 3 * radix.prefill_tokens, (paged.prefill_tokens, radix.prefill_tokens)
    cfg = offline.QUICK_SHARED_PREFIX
    ideal = cfg["num_groups"] * cfg["system_len"] + wl.num_requests * cfg["question_len"]
    assert radix.prefill_tokens == ideal  # every system prompt computed exactly once
    assert radix.radix_hit_rate == pytest.approx(radix.cached_tokens / wl.input_tokens)


# --------------------------------------------------------------------------------------- provenance and CLI


def test_provenance_records_machine_software_and_command():
    p = collect_provenance(["/x/minisgl_ref/__main__.py", "bench", "offline", "--quick"], engine_kwargs={"a": 1})
    assert p["command"] == "python -m minisgl_ref bench offline --quick"
    assert p["hardware"]["cpu"] and p["hardware"]["cpu_count"] >= 1
    assert p["software"]["torch"] == torch.__version__ and p["software"]["packages"]["torch"]
    assert p["software"]["python"] and p["date"].endswith("+00:00")
    assert p["settings"] == {"engine_kwargs": {"a": 1}}
    commit = git_commit()
    assert commit is None or (len(commit) == 40 and int(commit, 16) >= 0)
    assert command_line(["bench.py", "a b"]) == "bench.py 'a b'"
    json.dumps(p)


def test_cli_quick_ladder_writes_json_with_provenance(tmp_path):
    out = tmp_path / "tmp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl_ref", "bench", "offline", "--quick", "--stage", "all", "--output", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stage in offline.STAGES:
        assert stage in proc.stdout  # the table
    report = json.loads(out.read_text())
    prov = report["provenance"]
    assert prov["command"].startswith("python -m minisgl_ref bench offline --quick --stage all --output")
    assert prov["hardware"]["cpu"] and "gpu" in prov["hardware"] and "nvidia_driver" in prov["hardware"]
    for pkg in ("torch", "transformers", "minisgl_ref"):
        assert prov["software"]["packages"][pkg]
    assert prov["software"]["python"] and "git_commit" in prov["software"] and prov["date"]
    assert prov["settings"]["engine_kwargs"]["max_prefill_tokens"] == offline.QUICK_BUDGETS["max_prefill_tokens"]
    assert report["workload"]["name"] == "canonical" and report["model"]["name"] == offline.QUICK_MODEL_NAME
    results = report["results"]
    assert [r["stage"] for r in results] == list(offline.STAGES)
    for r in results:
        assert r["output_tokens"] == report["workload"]["output_tokens"] and r["aborted"] == 0
        assert r["output_throughput"] > 0 and r["wall_s"] > 0
        if r["device"] == "cpu":
            assert r["roofline_fraction"] is None  # the HBM roofline is reported on CUDA only
        else:
            assert 0 < r["roofline_fraction"] < 1
    paged = {r["stage"]: r for r in results}
    assert paged["paged"]["engine_args"]["disable_radix_cache"] is True
    assert paged["overlap"]["engine_args"]["disable_overlap_schedule"] is False
    assert paged["naive"]["prefill_tokens"] > paged["paged"]["prefill_tokens"]  # the oracle recomputes


def test_decode_balance_canonical_slots_scatter_the_generated_tokens(monkeypatch):
    """``--slot-order canonical``: each context's prompt in one run of slots, its generated tokens a batch of slots
    apart, and every slot of the pool (but the unused slot 0) belongs to exactly one token."""
    import benchmarks.decode_balance as db

    monkeypatch.setattr(db, "DEVICE", "cpu")
    lens, generated = [5, 9, 4], 3
    st = db.Stage(lens, generated=generated)
    slots = st.slots([0, 1, 2])
    assert sorted(slots.tolist()) == list(range(1, sum(lens) + 1))
    for i, n in enumerate(lens):
        own = st.token_slots[i]
        prompt = own[: n - generated]
        assert (prompt[1:] - prompt[:-1]).tolist() == [1] * (len(prompt) - 1)
        assert (own[n - generated + 1 :] - own[n - generated : -1]).tolist() == [len(lens)] * (generated - 1)
    plain = db.Stage(lens)
    assert plain.slots([0, 1, 2]).tolist() == list(range(1, sum(lens) + 1))
    assert db.generated_tokens(256) == 1  # every request runs at the first decode step, one token generated


def test_decode_allheads_matches_attention_per_head():
    """``benchmarks/decode_allheads.py`` (Triton's interpreter, float32): one program per piece of context for all
    KV heads, the other heads' scores masked out, gives each query head softmax attention over its own KV head,
    with contexts cut into several pieces (merged by the ``triton`` backend's stage 2) and slots out of order."""
    from benchmarks.decode_allheads import allheads_decode

    if torch.cuda.is_available() or type(__import__("triton").language.cdiv).__name__ == "JITFunction":
        pytest.skip("runs the kernel in Triton's interpreter, on the CPU")

    torch.manual_seed(0)
    heads, kv_heads, dim, lens = 16, 8, 128, [5, 40, 17]
    k, v = torch.randn(sum(lens) + 10, kv_heads, dim), torch.randn(sum(lens) + 10, kv_heads, dim)
    q = torch.randn(len(lens), heads, dim)
    slots = torch.randperm(sum(lens) + 10)[: sum(lens)].to(torch.int32)
    indptr = torch.tensor([0, 5, 45, 62], dtype=torch.int32)
    splits = 4
    mid_o, mid_lse = torch.empty(len(lens), heads, splits, dim), torch.empty(len(lens), heads, splits)
    out = torch.empty_like(q)
    allheads_decode(q, k, v, out, indptr, slots, mid_o, mid_lse, dim**-0.5, splits, min_split_len=8, block_n=4)
    for b in range(len(lens)):
        idx = slots[indptr[b] : indptr[b + 1]].long()
        kk, vv = k[idx].repeat_interleave(2, dim=1), v[idx].repeat_interleave(2, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[b], kk) * dim**-0.5).softmax(-1)
        torch.testing.assert_close(out[b], torch.einsum("hn,nhd->hd", probs, vv), atol=1e-5, rtol=1e-5)


def test_fused_gate_up_matches_projection_then_activation():
    """``benchmarks/fused_gate_up.py`` (Triton's interpreter, float32): one kernel that multiplies by the gate and
    up weights, takes each row's RMS on the way and applies ``silu(gate / rms) * (up / rms)`` gives the plain
    projection-then-activation, over several row tiles (the last one partial) and column tiles."""
    from benchmarks.fused_gate_up import gate_up_silu

    if torch.cuda.is_available() or type(__import__("triton").language.cdiv).__name__ == "JITFunction":
        pytest.skip("runs the kernel in Triton's interpreter, on the CPU")

    torch.manual_seed(0)
    rows, hidden, inter, eps = 37, 64, 48, 1e-6
    x, w = torch.randn(rows, hidden) * 3, torch.randn(2 * inter, hidden) * hidden**-0.5
    out = torch.empty(rows, inter)
    gate_up_silu(x, w, out, eps, (16, 16, 32, 4, 2))
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    gate, up = (normed @ w.T).chunk(2, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_gc_watch_counts_collections_while_entered():
    """``GCWatch`` (the timed run's ``gc_during_run``) counts the collections inside its block, by generation,
    and none after it."""
    import gc

    from minisgl_ref.bench.offline import GCWatch

    with GCWatch() as watch:
        gc.collect()
        gc.collect(0)
    gc.collect()
    summary = watch.summary()
    assert summary["collections"][2] == 1 and summary["collections"][0] >= 1
    assert summary["seconds"][2] > 0 and summary["tracked_objects_at_start"] > 0
