"""Write docs/benchmarks.md from the result files under docs/data/ (run after committing new results).

    python scripts/benchmarks_page.py            # rewrites docs/benchmarks.md

Every number on the page is read from a JSON file here, so the page cannot drift from the data it cites.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"


#: The index of every other result file, by the chapter and section that reads it.
OTHER_RESULTS = [
    "FP8 projections (`--quantization fp8`) on the canonical workload before their activations were quantized in "
    "one kernel (chapter 15, section 6; about ten PyTorch kernels per projection then): "
    "`docs/data/fp8_canonical_unfused_activation_h200.json`.",
    "Our split-KV CUDA decode kernel (chapter 11, section 4): alone and in the 28-layer chain "
    "`docs/data/decode_balance_split_cuda_h100.json`, `docs/data/decode_balance_split_cuda_with_matmuls_h100.json`; "
    "the engine's decode steps with it and with FlashInfer's persistent kernel "
    "`docs/data/decode_anatomy_split_h100.json`, `docs/data/decode_anatomy_persistent_h100.json`; three interleaved "
    "A/Bs `docs/data/canonical_ab_split_decode_h100.json`; GPU tests `docs/data/gpu_tests_split_decode_h100.txt`; "
    "its plan with fewer cuts, and from 48 rows: `docs/data/decode_balance_split_cap_h100.json`, "
    "`docs/data/decode_balance_split_cap_small_h100.json`, `docs/data/canonical_ab_split_cap_h100.json`; its GPU tests "
    "at that plan `docs/data/gpu_tests_split_cap_h100.txt`; small batches cut into more blocks, which did not pay "
    "`docs/data/decode_balance_min_blocks_h100.json`. The kernel's builds compiled only to be measured (other "
    "block sizes and rows per half-warp, streaming loads; checked in `docs/data/split_decode_check_h100.json`) "
    "have been removed since; the commit recorded in that file has them.",
    "The small kernels of a decode layer (chapter 11, section 4): the Triton QK-norm/RoPE/store and activation "
    "kernels with every load first `docs/data/fused_kernels_loads_first_h100.json`, "
    "`docs/data/canonical_ab_loads_first_h100.json`, GPU tests `docs/data/gpu_tests_loads_first_h100.txt`; two "
    "tries that did not pay: the split-KV kernel launched as a programmatic dependent "
    "`docs/data/dependent_launch_h100.json`, "
    "and the split-KV kernel finishing the raw QKV projection itself `docs/data/raw_decode_h100.json`, "
    "`docs/data/canonical_ab_raw_prologue_h100.json`.",
    "A fresh process on a machine whose compile caches were warm (kernels compiled by an earlier benchmark): "
    "`docs/data/canonical_fresh_process_split_cap_h100.json`; a wider GPU test run cut off by its time limit, the "
    "ten tests it finished all passing: `docs/data/gpu_tests_time_limited_h100.txt`; the whole GPU suite, 68 of its 69 "
    "tests passing and none failing (the 69th not collected on that machine): `docs/data/gpu_tests_full_h100.txt`.",
    "The host and the GPU on one clock in the tail of a canonical run (chapter 11, section 4): "
    "`docs/data/tail_timeline_h100.json`.",
    "Other decode attention kernels in a 28-layer chain with the matrix multiplies (chapter 11, section 4): "
    "`docs/data/decode_balance_triton_h100.json`, `docs/data/decode_balance_chunks_h100.json`, "
    "`docs/data/decode_balance_xqa_h100.json`.",
    "A decode step's matrix multiplies with their weights in L2, an L2 prefetch during attention, TunableOp "
    "(chapter 11, section 4): `docs/data/matmul_latency_h100.json`.",
    "The MLP's gate/up multiply and its activation in one Triton kernel against cuBLAS and the activation kernel "
    "(chapter 11, section 4): `docs/data/fused_gate_up_h100.json`; the first version, which Triton compiled wrong "
    "for many tile shapes: `docs/data/fused_gate_up_one_loop_h100.json`.",
    "The canonical workload from three more cold starts, a first and a second process each, one pair traced step "
    "by step with the garbage collector's work counted (chapter 11, section 4): "
    "`docs/data/canonical_cold_start_repeats_h100.json`.",
    "Checking a burst's prompt ids id by id against in C, and the canonical A/B of that change (chapter 11, "
    "section 5): `docs/data/prompt_checks_h100.json`, `docs/data/canonical_ab_prompt_checks_h100.json`.",
    "The first prefill phase of a fresh engine against a later one (chapter 11, section 4): "
    "`docs/data/first_prefill_h100.json`.",
    "The host and GPU timeline of a timed run's first steps, with the prefill phase launched eagerly and with the "
    "budget step as a CUDA graph, and the canonical A/B of that graph on two machines (chapter 11, section 4): "
    "`docs/data/run_start_eager_prefill_h100.json`, `docs/data/run_start_budget_graph_h100.json`, "
    "`docs/data/canonical_ab_budget_graph_h100.json`, `docs/data/gpu_tests_budget_graph_h100.txt`.",
    "Attention kernels against the memory roofline (chapter 07): `docs/data/gpu_kernels_h100.json`.",
    "Online serving (chapter 10): `docs/data/bench_serving_h100.json`, `docs/data/bench_serving_cpu.json`.",
    "Prefix sharing, CPU quick run (chapter 04): `docs/data/bench_offline_quick_shared_prefix_cpu.json`.",
    "Start-up, first run, cascade decode on a shared prefix, grouped admission (chapter 11, sections 5-6): "
    "`docs/data/startup_and_cascade_h100.json`.",
    "Online serving at three request rates and saturation, default and mixed chunks (chapter 11, section 7): "
    "`docs/data/bench_serving_sweep_h100.json`.",
    "CPU time per streamed token in the API server and the benchmark client (chapter 11, section 8): "
    "`docs/data/stream_cost_cpu.json`.",
    "The engine's step gaps beside the client's latencies, and the step that launches a prefill (chapter 11, "
    "section 7): `docs/data/serving_step_gaps_h100.json`, `docs/data/prefill_stall_h100.json`, "
    "`docs/data/prefill_stall_fixed_h100.json`, `docs/data/canonical_steps_h100.json`.",
    "What that step waits for and what two fixes bought (extend steps padded to 64 tokens with their matmul shapes "
    "met at start-up, FlashAttention-3's operator called directly; chapter 11, section 7): "
    "`docs/data/prefill_timeline_h100.json`, `docs/data/matmul_first_call_h100.json`, "
    "`docs/data/prefill_stall_ab_h100.json`, `docs/data/serving_pad_ab_h100.json`, `docs/data/canonical_pad_h100.json`.",
    "Extend steps in CUDA graphs, one request (`docs/data/prefill_stall_graphs_h100.json`, "
    "`docs/data/serving_extend_graphs_h100.json`, `docs/data/gpu_extend_graph_tests_h100.txt`) and 2, 16 or 64 rows, "
    "with and without mixed steps (`docs/data/serving_mixed_graphs_h100.json`, "
    "`docs/data/gpu_mixed_extend_graph_tests_h100.txt`).",
    "The canonical workload's first run from a cold start and a warm start: with one-request extend graphs "
    "`docs/data/canonical_startup_extend_graphs_h100.json`; with the graphs of several rows and the split draw "
    "`docs/data/canonical_startup_multirow_graphs_h100.json` (with eager warm-ups before every extend graph: "
    "`docs/data/canonical_startup_all_warmups_h100.json`); at the latest engine "
    "`docs/data/canonical_cold_start_h100.json`.",
    "The sampler's draw split over the vocabulary against one program per row, in one process: "
    "`docs/data/sampler_ab_h100.json`, and the decode profile that showed its cost: `docs/data/decode_profile_h100.txt`. "
    "Logits kept in bf16 against converted to float32, interleaved processes: `docs/data/logits_bf16_ab_h100.json`.",
    "Where a decode step's time goes at every stage of the canonical workload (chapter 11, section 4): "
    "`docs/data/decode_anatomy_h100.json`; interleaved A/B processes of the last changes (the query read in place, the "
    "KV store inside the RoPE kernel, a burst admitted in one step): `docs/data/canonical_ab_qview_h100.json`, "
    "`docs/data/canonical_ab_fused_store_h100.json`, `docs/data/canonical_ab_admission_h100.json`; KV pages of 64 "
    "slots against 1: `docs/data/canonical_ab_page_size_h100.json`.",
    "Decode attention on the workload's own context lengths against equal-length controls, and the ways of cutting "
    "its work (chapter 11, section 4): `docs/data/decode_balance_h100.json`, with every stage and FlashAttention-3: "
    "`docs/data/decode_balance_stages_h100.json`; contexts cut into pieces of 128 or 256 tokens, on an H200: "
    "`docs/data/decode_balance_chunks_h200.json`; FlashInfer's persistent `BatchAttention`: "
    "`docs/data/decode_balance_holistic_h100.json`, its cost of planning every step: "
    "`docs/data/decode_balance_plan_cost_h100.json`, and the canonical workload with it from 64 rows, interleaved "
    "processes: `docs/data/canonical_ab_persistent_h100.json`, with its plan uploaded on a side stream: "
    "`docs/data/canonical_ab_persistent_staged_h100.json`, and its GPU tests: "
    "`docs/data/gpu_tests_persistent_decode_h100.txt` (the engine's persistent decode path and its "
    "`--persistent-decode-min-batch` flag have been removed since; the commit recorded in "
    "`docs/data/canonical_ab_persistent_staged_h100.json` has them). A decode step cut in "
    "two halves whose attention and "
    "matrix multiplies overlap in two streams: `docs/data/overlap_decode_h100.json`.",
    "The GPU's gaps between the kernels of a decode step, and the sampler's float32 exponential against the float64 "
    "one in one process (chapter 11, section 4): `docs/data/decode_anatomy_gaps_h100.json`, "
    "`docs/data/sampler_race_f32_ab_h100.json`; its score's logarithm from lg2.approx "
    "`docs/data/sampler_fast_log_draw_h100.json`, `docs/data/sampler_fast_log_ab_h100.json`; "
    "the GPU tests of the Triton attention kernels: "
    "`docs/data/gpu_tests_triton_kernels_h100.txt`. One step's matrix multiplies alone, cuBLAS, cuBLASLt and a "
    "plain Triton kernel: `docs/data/decode_matmuls_h100.json`; against a split-K Triton kernel with programmatic "
    "dependent launch and an L2 prefetch of the weights: `docs/data/decode_matmuls_pdl_h100.json` (a first version "
    "that let its dependents launch before its own wait: `docs/data/decode_matmuls_pdl_early_trigger_h100.json`). "
    "The gaps again with copies counted as events, beside unprofiled wall times: "
    "`docs/data/decode_anatomy_copies_h100.json`. The KV cache read in 256-byte pieces against whole rows, for "
    "several slot orders: `docs/data/gather_bandwidth_h100.json`. The prefill phase of the canonical workload by "
    "kernel kind, before and after QK-norm, RoPE and the KV store ran as one kernel in prefill steps too: "
    "`docs/data/prefill_anatomy_h100.json`, `docs/data/prefill_anatomy_fused_h100.json`; the A/Bs "
    "`docs/data/canonical_ab_prefill_rope_store_h100.json`, `docs/data/canonical_ab_prefill_fused_h100.json`; "
    "its GPU tests `docs/data/gpu_tests_prefill_store_h100.txt`. The step's copies moved to streams of their own "
    "(not adopted: no gain): `docs/data/canonical_ab_copy_streams_h100.json`, its GPU tests "
    "`docs/data/gpu_tests_copy_streams_h100.txt`.",
    "The layers' norms folded into the kernels around them (chapter 11, section 4): the interleaved A/B "
    "`docs/data/canonical_ab_norm_folding_h100.json`, a decode step's kernels after it "
    "`docs/data/decode_anatomy_folded_h100.json`, the prefill phase `docs/data/prefill_anatomy_folded_h100.json`, "
    "a cold start with it `docs/data/canonical_cold_start_folded_h100.json`, its GPU tests "
    "`docs/data/gpu_tests_norm_folding_engine_h100.txt`, `docs/data/gpu_tests_norm_folding_h100.txt`, "
    "`docs/data/gpu_tests_norm_folding_suite_h100.txt`. Decode attention with a cache per layer and the engine's "
    "slot layout: `docs/data/gather_bandwidth_layers_h100.json`, `docs/data/decode_balance_layers_h100.json`; "
    "between a layer's matrix multiplies: `docs/data/decode_balance_with_matmuls_h100.json`, with a plain copy "
    "instead: `docs/data/decode_balance_l2_control_h100.json`, with its plan read first: "
    "`docs/data/decode_balance_plan_warm_h100.json`, with a tiny kernel or a 16 x 16 multiply instead: "
    "`docs/data/decode_balance_boundaries_h100.json`, the SM clock meanwhile: `docs/data/clock_probe_h100.json`, "
    "after a one-request call of the same kernel: `docs/data/decode_balance_code_warm_h100.json`; "
    "the persistent kernel from 144 rows instead of 64: "
    "`docs/data/canonical_ab_persistent_threshold_h100.json`, its GPU tests "
    "`docs/data/gpu_tests_persistent_threshold_h100.txt`. Not adopted: KV pages of 64 slots with the persistent "
    "kernel `docs/data/canonical_ab_page_size_persistent_h100.json`, cuBLASLt for every matmul "
    "`docs/data/canonical_ab_cublaslt_h100.json`.",
    "Constrained decoding against free decoding, and jump-forward (chapter 12), with the model in float32: random "
    "weights `docs/data/constrained_bench_h100.json`, `docs/data/constrained_bench_typical_h100.json`; the embedded "
    "model's real weights `docs/data/constrained_bench_real_typical_h100.json`, "
    "`docs/data/constrained_bench_real_bounded_h100.json`, and the device profile of a float32 jump-forward run: "
    "`docs/data/constrained_bench_f32_jump_profile_h100.txt`. In bfloat16, with and without mixed steps: "
    "`docs/data/constrained_bench_typical_plain_h100.json`, `docs/data/constrained_bench_typical_mixed_h100.json`. "
    "The grammar's host work per decode step, part by part, on a 2-core CPU: `docs/data/grammar_host_cpu.json`. "
    "Five alternating runs per kind, one process per engine version (chapter 12, section 7): "
    "`docs/data/constrained_order_ab_h100.json`, `docs/data/constrained_fill_ab_h100.json`, the full table with "
    "fills decided step by step `docs/data/constrained_bench_typical_adaptive_h100.json`, a host profile "
    "`docs/data/constrained_bench_typical_profile_h100.txt`, and the host side of a bitmask's copy "
    "`docs/data/h2d_copy_h100.json`; the GPU tests of constrained decoding with pinned, double-buffered masks: "
    "`docs/data/gpu_tests_constrained_h100.txt`. Against a larger model's forward pass: the embedded model "
    "zero-padded to 2.1B parameters `docs/data/constrained_bench_typical_padded_h100.json`, the 135M model on the "
    "same machine `docs/data/constrained_bench_typical_135m_h100.json`, and SmolLM2-1.7B's shape with random "
    "weights `docs/data/constrained_bench_typical_random_1p7b_h100.json`; after the detokenizer's decode went to the "
    "Rust tokenizer, with the old decode as a control on the same machine: "
    "`docs/data/constrained_bench_typical_padded_rustdecode_h100.json`, "
    "`docs/data/constrained_bench_typical_padded_hfdecode_h100.json`, "
    "`docs/data/constrained_bench_typical_135m_rustdecode_h100.json`.",
    "The GPU test suite (`pytest -m gpu`: attention backends against torch_native, CUDA-graph replays, cascade "
    "attention, fused ops, sampling): every GPU test passed on an H100, 60 tests "
    "(`docs/data/gpu_tests_suite_h100.txt`); the graph, sampling, fused-kernel and cascade tests again after the KV "
    "store moved into the RoPE kernel, 34 tests (`docs/data/gpu_tests_kv_store_in_rope_h100.txt`).",
    "The sampler's race skipping the blocks that cannot win (chapter 11, section 4): the draw alone with and "
    "without it `docs/data/race_prune_h100.json`, `docs/data/race_prune_chunks_h100.json`; the canonical workload "
    "with the two races alternating in one process `docs/data/sampler_prune_ab_h100.json`, in interleaved "
    "processes `docs/data/canonical_ab_race_prune_h100.json`; the GPU tests of sampling, CUDA graphs, folded norms "
    "and fused kernels with it, 27 tests `docs/data/gpu_tests_prune_h100.txt`. The five cold starts before it: "
    "`docs/data/canonical_cold_start_split_cap_h100.json`, `docs/data/canonical_cold_start_split_cap_2_h100.json`, "
    "`docs/data/canonical_cold_start_loads_first_h100.json`, "
    "`docs/data/canonical_cold_start_loads_first_2_h100.json`, `docs/data/canonical_cold_start_fast_log_h100.json` "
    "(first runs of 19,875-20,251 output tok/s).",
]


#: How the rows of the optimization history were measured (the data file's own note has every detail).
HISTORY_NOTE = (
    "The first three entries are each the first full-size run of a fresh process (kernels for large prefill shapes "
    "still compiling in the timed run); the fourth is a warm run. From the fifth entry on, every entry is the first "
    "full-size run after an untimed 32-request warm-up, *again* is the same run repeated in the same process, and the "
    "fourth column gives runs with one change off, in the same process. The later entries are medians of interleaved "
    "A/B processes: the engine with the change against the engine just before it (the data file says how many runs "
    "and processes each had). Each of those entries was measured on its own machine, and machines differ by a few "
    "percent: compare an entry with its own baseline, not with its neighbours."
)

#: What the tensor-parallel runs share, and where their correctness check comes from.
TP_NOTES = (
    "Engine settings: FA3 attention for prefill and decode and `MINISGL_FUSED=0` (plain RMSNorm/SiLU/RoPE), the same "
    "at tp=1 and tp=2.",
    "The check comes from a separate run of `python -m benchmarks.tp --phase check --tp-size 2` on a fresh "
    "2 x H200 machine: in the first run the tp=2 engine hung while shutting NCCL down (fixed since: tp=2 now shuts "
    "down in about a second).",
)


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def offline_section() -> list[str]:
    g = load("gpu_offline_h100.json")
    prov, hw, sw = g["provenance"], g["provenance"]["hardware"], g["provenance"]["software"]
    pk = sw["packages"]
    floor, floor_ds = g["roofline_floor_s"], g["roofline_floor_s_datasheet"]
    tokens = g["canonical_output_tokens"]
    c, again = g["canonical"], g.get("canonical_repeat")
    out = [
        "## Offline throughput on an H100 (chapters 08 and 11)",
        "",
        "Data: [`docs/data/gpu_offline_h100.json`](data/gpu_offline_h100.json) (and the profile tables "
        "`gpu_offline_h100_profile_decode.txt`, `gpu_offline_h100_host_profile.txt` beside it). Measured by "
        f"`bash scripts/gpu/measure/offline.sh bench` on an **{hw['gpu']}** (driver {hw['nvidia_driver']}, CUDA "
        f"{hw['cuda_runtime']}), torch {sw['torch']}, triton {pk['triton']}, flashinfer {pk['flashinfer-python']}, "
        f"FA3 (`flash_attn_interface`), {prov['date'][:16].replace('T', ' ')} UTC. "
        "Model: Qwen3-0.6B config, bf16, dummy weights.",
        "",
        "**Canonical offline workload** (256 requests, prompts 100-1024 and outputs 100-1024 tokens, temperature 0.6, "
        f"`ignore_eos`; {tokens:,} output tokens), full engine with default settings (FA3 prefill, FlashInfer decode, "
        "overlap scheduling, radix cache, chunked prefill, CUDA graphs, fused kernels), after an untimed warm-up:",
        "",
        "| | output tok/s | wall s | of the floor (measured bandwidth) | of the datasheet floor |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    rows = [("full engine", c), ("the same, again (same process)", again),
            ("without the token-copy event (`.tolist()` per step)", g.get("canonical_sync_tokens")),
            ("without our Triton per-token kernels", g.get("canonical_no_triton_fused"))]
    for label, r in rows:
        if r:
            out.append(f"| {label} | **{r['output_throughput']:,.0f}** | {r['wall_s']:.2f} | "
                       f"{pct(r['roofline_fraction'])} | {pct(floor_ds / r['wall_s'])} |")
    best = max(r["output_throughput"] for _, r in rows[:2] if r)
    out += [
        "",
        f"The floor is {floor:.2f} s: every decode step reads the weights once and each request's KV context "
        "(`bytes = max(O_i) * W + sum_i sum_j (P_i + j) * kv_bytes_per_token`, chapter 11) at the device-to-device "
        f"copy bandwidth measured in the same run, {g['copy_bandwidth_Bps'] / 1e12:.2f} TB/s. At the datasheet's "
        f"3.35 TB/s it is {floor_ds:.2f} s (~29.7k tok/s). The target, 17,000 tok/s (~60% of "
        f"the datasheet floor), is **{'reached' if best >= 17_000 else 'not reached'}** in this run. Across separate "
        "runs on the same machine, the default engine varied by about 4% from run to run "
        "(see the history below).",
        "",
        "**The stage ladder, attention backends and CUDA graphs.** Rows with 8 requests use a reduced workload: the "
        "canonical recipe with 8 requests and outputs of 100-256 tokens (`canonical_workload(n, output_len=...)`), so "
        "that the naive oracle and the torch_native stages finish in minutes; the other rows run the full 256-request "
        "canonical workload.",
        "",
        "| configuration | requests | output tok/s | wall s | of floor |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in g["ladder"]:
        out.append(f"| {r['label']} | {r['workload_requests']} | {r['output_throughput']:,.0f} | {r['wall_s']:.2f} | "
                   f"{pct(r['roofline_fraction'])} |")
    steps_prov = g.get("decode_steps_provenance", prov)
    out += [
        "",
        "**CUDA graphs: decode step time** (attention metadata + forward + logits, every request at a context of 512 "
        "tokens, default backends; CUDA events over 50 steps; eager steps are host-bound, and the host's speed varies "
        f"between runs). Target: at least 2x at batch 1. Measured {steps_prov['date'][:16].replace('T', ' ')} UTC.",
        "",
        "| batch | eager ms | graph ms | speedup |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for r in g["decode_steps"]:
        out.append(f"| {r['batch_size']} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} | {r['speedup']:.2f}x |")
    by = g.get("decode_steps_by_backend", [])
    if by:
        out += ["", "Graphed decode step by decode backend (ms; measured earlier, before the Triton per-token kernels):",
                "", "| batch | flashinfer | fa3 | triton |", "| ---: | ---: | ---: | ---: |"]
        table: dict[int, dict[str, float]] = {}
        for r in by:
            table.setdefault(r["batch_size"], {})[r["decode_backend"]] = r["graph_ms"]
        for b, row in sorted(table.items()):
            out.append(f"| {b} | " + " | ".join(f"{row.get(k, float('nan')):.2f}" for k in ("flashinfer", "fa3", "triton"))
                       + " |")
    out += ["", "**What each per-step optimization bought** (chapters 06, 08 and 11; one row per change, in the order "
            "they went in). " + HISTORY_NOTE, "",
            "| output tok/s | again | of floor | without the change (same machine) | change |",
            "| ---: | ---: | ---: | ---: | --- |"]
    for h in g["history"]:
        again_tp = h.get("repeat_output_throughput")
        ab = [f"{h[k]:,.0f} ({k.split('_output')[0].replace('_', ' ')})" for k in
              ("without_token_copy_event_output_throughput", "without_triton_fused_output_throughput") if k in h]
        if "baseline_output_throughput" in h:
            ab.append(f"{h['baseline_output_throughput']:,.0f} (engine before the change)")
        out.append(f"| {h['output_throughput']:,.0f} | {'' if again_tp is None else f'{again_tp:,.0f}'} | "
                   f"{pct(h['roofline_fraction'])} | {'; '.join(ab)} | {h['change']} |")
    launch = load("launch_overhead_h100.json")
    out += ["", "**Host time per kernel launch** (`scripts/gpu/measure/launch_overhead.py`, tiny tensors, host-bound; "
            "why our Triton kernels run only in graph-replayed decode steps):", "",
            "| launcher | us per launch |", "| --- | ---: |"]
    out += [f"| {k} | {v:.1f} |" for k, v in launch["us_per_launch"].items()]
    out += ["", "Reproduce: `bash scripts/gpu/chapter.sh 08` (the GPU tests and every measurement above), or "
            "`python -m minisgl_ref bench offline` (`--disable-cuda-graph`, `--attention-backend NAME`, `--stage all`). "
            "On a CPU, in seconds: `python -m minisgl_ref bench offline --quick --stage all` (a tiny model: ratios, "
            "not speeds).", ""]
    return out


def tp_section() -> list[str]:
    t = load("tp_bench_h200.json")
    prov = t["provenance"]
    chk = t["tp_check"]
    out = ["## Tensor parallelism on two H200s (chapter 09)", "",
           f"Data: [`docs/data/tp_bench_h200.json`](data/tp_bench_h200.json) (its log: "
           "[`docs/data/tp_bench_h200.log`](data/tp_bench_h200.log)). "
           f"`scripts/gpu/measure/tp_bench.sh` on **2 x {prov['hardware']['gpu']}** (NCCL, NVLink multicast off), "
           f"{prov['date'][:16].replace('T', ' ')} UTC; Qwen3-14B config, "
           "bf16, dummy weights, FA3 attention, plain element-wise ops (`MINISGL_FUSED=0`).", "",
           "| | tp=1 | tp=2 | tp=2 / tp=1 |", "| --- | ---: | ---: | ---: |"]
    r1, r2 = t["tp1_run"], t["tp2_run"]
    d1 = {d["batch_size"]: d["step_s"] for d in r1["decode"]}
    d2 = {d["batch_size"]: d["step_s"] for d in r2["decode"]}
    for b in sorted(set(d1) & set(d2)):
        out.append(f"| decode step, batch {b} (ms) | {d1[b] * 1e3:.2f} | {d2[b] * 1e3:.2f} | "
                   f"{d1[b] / d2[b]:.2f}x faster |")
    c1, c2 = r1.get("canonical"), r2.get("canonical")
    if c1 and c2:
        out.append(f"| canonical workload (output tok/s) | {c1['output_throughput']:,.0f} | "
                   f"{c2['output_throughput']:,.0f} | {c2['output_throughput'] / c1['output_throughput']:.2f}x |")
    out.append(f"| KV pool (tokens per GPU) | {r1['max_total_tokens']:,} | {r2['max_total_tokens']:,} | |")
    out += ["", f"Check (Qwen3-0.6B, bf16): tp=2 logits {chk['tp2_vs_float32']:.2e} from float32, tp=1 "
            f"{chk['tp1_vs_float32']:.2e} (bf16 rounding noise); ranks identical: {chk['ranks_identical']}; greedy "
            f"tokens agree for {chk['greedy_common_prefix']} of {len(chk['greedy_tp1'][0])} tokens (until the first "
            "near-tie of random weights).", ""]
    out += [f"- {note}" for note in TP_NOTES] + [f"- {t['notes']['greedy']}"]
    out.append("")
    return out


def parallel_serving_section() -> list[str]:
    """Tensor- and data-parallel serving on two GPUs, as a user starts and stops it (chapters 09 and 10)."""
    doc = load("parallel_serving_h200.json")
    phases = {name: (run, ph) for run in doc["runs"] for name, ph in run["phases"].items()
              if "error" not in ph and not ph.get("check", {}).get("killed")}
    run, check = phases["tp_exit"]
    serve, dp = phases["tp_serve"][1], phases["dp"][1]
    sigterm = next(r["phases"]["tp_exit"]["sigterm"] for r in doc["runs"] if r["phases"].get("tp_exit", {}).get("sigterm"))
    prov = run["provenance"]
    c = check["check"]
    one, two = dp["dp1"], dp["dp2"]
    out = ["## Serving with tensor and data parallelism on two H200s (chapters 09 and 10)", "",
           "Data: [`docs/data/parallel_serving_h200.json`](data/parallel_serving_h200.json) (its log: "
           "[`docs/data/parallel_serving_h200.log`](data/parallel_serving_h200.log)), from "
           f"`scripts/gpu/measure/parallel_serving.py` on **{len(prov['gpus'])} x {prov['gpus'][0].split(',')[0]}** "
           f"(torch {prov['torch']}, flashinfer {prov['flashinfer']}, NVLink multicast off); Qwen3-0.6B config, bf16, "
           "dummy weights. Each phase in the file carries its own commit.", "",
           "| what | measured |", "| --- | --- |",
           f"| the tp=2 check as a process | result after {c['result_after_s']:.0f} s (a cold start: every kernel "
           f"compiled first), exit {c['exit_after_result_s']:.1f} s later; greedy tokens equal tp=1 for "
           f"{c['result']['greedy_common_prefix']} of 32 |",
           f"| `serve --tp-size 2` | ready in {serve['ready_s']:.0f} s; no failed start-up compile on either rank |",
           f"| {serve['storm']['clients']} streaming clients that disconnect at random moments | nothing running "
           f"{serve['storm']['idle_after_s']:.2f} s later, `/health` {serve['after_storm']['health']}, same greedy "
           f"tokens after: {serve['after_storm']['greedy_again_identical']} |",
           f"| SIGTERM to `serve --tp-size 2` | all {serve['stop']['processes']} processes gone in "
           f"{serve['stop']['all_exited_s']:.1f} s (status {serve['stop']['exit_code']}) |",
           f"| SIGTERM to an offline `LLM(tp_size=2)` in the middle of generate | all {sigterm['processes']} processes "
           f"gone in {sigterm['all_exited_s']:.1f} s |",
           f"| {dp['prompts']} requests at once, one server on one GPU | {one['request_throughput']:.0f} req/s, "
           f"{one['output_throughput']:,.0f} output tok/s, TTFT median {one['median_ttft_ms'] / 1e3:.1f} s |",
           f"| the same, `serve --dp-size 2` (one worker per GPU behind SGLang's router) | "
           f"{two['request_throughput']:.0f} req/s ({dp['dp2_over_dp1_request_throughput']:.2f}x), "
           f"{two['output_throughput']:,.0f} output tok/s, TTFT median {two['median_ttft_ms'] / 1e3:.1f} s |",
           f"| one data-parallel worker killed (SIGKILL) mid-run | launcher exit status "
           f"{dp['after_kill']['launcher_exit_code']} after {dp['after_kill']['launcher_exit_s']:.1f} s, no process "
           "left |", ""]
    out += ["The file holds three runs; each phase above comes from the run that completed it:", "",
            "| run | what it measured and how it ended |", "| ---: | --- |"]
    out += [f"| {i + 1} | {r['note']} |" for i, r in enumerate(doc["runs"])]
    out.append("")
    return out

def seams_section() -> list[str]:
    """The engine before and after its later chapters moved behind the core's seams (docs/architecture.md)."""
    ab = load("canonical_ab_extensions_h200.json")
    sp = load("shared_prefix_radix_h200.json")["runs"]
    tp = load("tp_check_h200.json")
    hw = ab["provenance"]["hardware"]
    (old, a), (new, b) = ab["summary"].items()

    def tok_s(run: str) -> float:
        return sp[run]["results"][0]["output_throughput"]

    out = ["## Later chapters behind the core's seams: the same engine (chapters 06-12)", "",
           "Structured output, cascade and split-KV decode attention, the fused kernels and folded norms plug into the "
           "core through declared seams ([architecture](architecture.md#seams-how-later-chapters-plug-in)); before, "
           f"they were built into the engine's own classes. The two versions, side by side on an {hw['gpu']} (driver "
           f"{hw['nvidia_driver']}), by the commit each was measured at:", "",
           f"| what | built in ({old}) | behind the seams ({new}) |", "| --- | ---: | ---: |",
           f"| canonical workload, output tok/s, interleaved processes (median; range) | {a['median']:,.0f} "
           f"({a['min']:,.0f}-{a['max']:,.0f}) | {b['median']:,.0f} ({b['min']:,.0f}-{b['max']:,.0f}) |"]
    ratios = []
    for label in (old, new):
        on, off = tok_s(f"{label}_radix_on"), tok_s(f"{label}_radix_off")
        ratios.append(f"{on:,.0f} / {off:,.0f} ({on / off:.2f}x)")
    out += [f"| shared-prefix workload, output tok/s, radix cache on / off | {ratios[0]} | {ratios[1]} |", "",
            "Data: [`canonical_ab_extensions_h200.json`](data/canonical_ab_extensions_h200.json) "
            "(`scripts/gpu/ab.sh`; start-up times in its note), "
            "[`shared_prefix_radix_h200.json`](data/shared_prefix_radix_h200.json); the GPU tests "
            "[`gpu_tests_h200.txt`](data/gpu_tests_h200.txt); tensor parallelism on two GPUs: "
            f"[`tp_check_h200.json`](data/tp_check_h200.json) (tp=2 logits against tp=1: relative error "
            f"{tp['logits_rel_err_norm']:.4f}, argmax agreement {tp['argmax_agreement']:.2f}, ranks identical "
            f"{tp['ranks_identical']}; greedy tokens equal tp=1 for {tp['greedy_common_prefix']} of 32), "
            "[`parallel_serving_tp2_h200.json`](data/parallel_serving_tp2_h200.json) (`serve --tp-size 2`).", ""]
    return out


def moe_section() -> list[str]:
    """Qwen3-30B-A3B on one H200: the canonical workload with its routing counted, and fused against the loop."""
    run_doc = load("moe_canonical_h200.json")
    run, prov = run_doc["results"][0], run_doc["provenance"]
    dist = run["expert_distribution"]
    active = sum(dist["active_expert_steps"]) / (dist["steps"] * len(dist["layer_ids"]))
    e2e = load("moe_endtoend_h200.json")
    return ["## Mixture of experts on one H200 (chapter 14)", "",
            f"Qwen3-30B-A3B config, bf16, dummy weights, {prov['hardware']['gpu']}: `python -m minisgl_ref bench "
            "offline --model-path qwen3-30b-a3b "
            "--load-format dummy --enable-expert-distribution-metrics --hbm-bandwidth 4.278e12`.", "",
            "| canonical workload | commit | output tok/s | wall s | floor, every expert (s) | of it | experts routed "
            "per layer and step | floor, routed experts (s) | of it |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| fused kernel, CUDA graphs | {prov['software']['git_commit'][:7]} | "
            f"**{run['output_throughput']:,.0f}** | {run['wall_s']:.1f} | "
            f"{run['roofline_floor_s']:.1f} | {run['roofline_fraction']:.1%} | {active:.1f} of {dist['num_experts']} | "
            f"{run['routed_floor_s']:.1f} | {run['routed_floor_fraction']:.1%} |", "",
            f"The fused kernel against the reference loop over experts, CUDA graphs off, {e2e['requests']} requests: "
            f"{e2e['speedup_fused_over_reference']:.1f}x (median wall {e2e['median_wall_s']['fused']:.2f} s against "
            f"{e2e['median_wall_s']['reference']:.2f} s). Data: [`moe_canonical_h200.json`](data/moe_canonical_h200.json), "
            "[`moe_endtoend_h200.json`](data/moe_endtoend_h200.json), one layer: "
            "[`moe_kernel_h200.json`](data/moe_kernel_h200.json).", ""]


def fp8_section() -> list[str]:
    """The canonical workload by FP8 variant on one H200, each against its own floor."""
    doc = load("fp8_canonical_h200.json")
    runs = {(r["variant"], r["round"]): r for r in doc["rows"]}
    prov = doc["rows"][0]["provenance"]
    out = ["## FP8 weights and KV cache on one H200 (chapter 15)", "",
           f"Qwen3-0.6B config, bf16, dummy weights, {prov['hardware']['gpu']}; one fresh process per run; each "
           "floor from the engine's own stored bytes at 4.278 TB/s.", "",
           "| variant | flags | commit | output tok/s, cold | warm | floor (s) | of it | KV read per decode step (GB) |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    flags = {"bf16": "", "fp8": "`--quantization fp8`", "w8a8_fp8": "`--quantization w8a8_fp8`",
             "fp8_kv": "`--kv-cache-dtype fp8_e4m3`", "both": "`--quantization fp8 --kv-cache-dtype fp8_e4m3`"}
    for v, f in flags.items():
        cold, warm = runs[(v, "cold")], runs.get((v, "warm"))
        best = warm or cold
        out.append(f"| {v} | {f} | {cold['provenance']['software']['git_commit'][:7]} | "
                   f"{cold['output_throughput']:,.0f} | "
                   f"{'-' if warm is None else format(warm['output_throughput'], ',.0f')} | "
                   f"{best['roofline_floor_s']:.2f} | {best['roofline_fraction']:.1%} | "
                   f"{best['kv_bytes_per_decode_step'] / 1e9:.2f} |")
    return out + ["", "Data: [`fp8_canonical_h200.json`](data/fp8_canonical_h200.json); decode steps by KV and weight "
                  "format: [`fp8_decode_steps_h200.json`](data/fp8_decode_steps_h200.json); perplexity on the CPU: "
                  "[`perplexity_cpu.json`](data/perplexity_cpu.json).", ""]


#: The engine as it stands, from cold starts (newest last): the page opens with them.
LATEST_COLD = ["canonical_cold_start_prune_h100.json"] + [f"canonical_cold_start_prune_{i}_h100.json"
                                                           for i in range(2, 6)]


def latest_section() -> list[str]:
    """The canonical workload from cold starts with the engine at the end of chapter 11: first and second process."""
    docs = [(name, load(name)) for name in LATEST_COLD]
    prov = docs[-1][1]["cold"]["provenance"]
    hw, sw = prov["hardware"], prov["software"]
    out = ["## The engine as it stands: first run from a cold start (chapter 11)", "",
           "`bash scripts/gpu/bench.sh OUT.json` runs `python -m minisgl_ref bench offline` (the canonical "
           "workload, Qwen3-0.6B config, bf16, dummy weights) in a first process on a fresh machine, its compile "
           "caches empty (a cold start), then in a second process. One row per machine; machines differ by a few percent. "
           f"{hw['gpu']} (driver {hw['nvidia_driver']}), torch {sw['torch']}, flashinfer "
           f"{sw['packages'].get('flashinfer-python')}.", "",
           "| data | commit | first process: output tok/s | of the floor | start-up s | second process: output tok/s "
           "| start-up s | kernels compiled during the runs |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, doc in docs:
        cold, warm = doc["cold"]["results"][0], doc["warm"]["results"][0]
        out.append(f"| [`{name}`](data/{name}) | {doc['git_commit'][:7]} | **{cold['output_throughput']:,.0f}** | "
                   f"{cold['roofline_fraction']:.1%} | {cold['startup_s']:.1f} | {warm['output_throughput']:,.0f} | "
                   f"{warm['startup_s']:.1f} | {compiled_during(cold) + compiled_during(warm)} |")
    return out + ["", "The second machine's first process compiled the sampler's pruning kernel inside its timed run "
                  "(start-up compiled only the one-block variant then; it now compiles both), and the "
                  "machine is a slow one: its second process, with nothing to compile, ran at 19,306.", ""]


def compiled_during(run: dict) -> int:
    """Kernels compiled inside a timed run (Triton, Inductor, FlashInfer), from its cache counters."""
    return sum(run["compiled_during_run"].values())


def render() -> str:
    """The page's Markdown, from the result files alone."""
    page = ["# Benchmarks", "",
            "Every number on this page comes from a JSON file committed under `docs/data/`, which records the command, "
            "the hardware, the software versions and the time it was measured; `python scripts/benchmarks_page.py` "
            "writes this page from them. The chapters that produce the numbers read the same files and plot them: "
            "each chapter's page shows its plots and tables next to the code that draws them.", ""]
    page += latest_section() + offline_section() + tp_section() + parallel_serving_section() + seams_section()
    page += moe_section() + fp8_section()
    page += ["## Other results", "", *(f"- {line}" for line in OTHER_RESULTS), ""]
    return "\n".join(page)


def main() -> None:
    (ROOT / "docs" / "benchmarks.md").write_text(render())


if __name__ == "__main__":
    main()
