"""``python -m benchmarks.decode_balance``: decode attention on the canonical workload's own context lengths
(chapter 11).

With every request at the same length, FlashInfer's decode kernel reads the KV cache of 256 requests at ~3.0 TB/s
on an H100 (``gpu_kernels_h100.json``). Inside the canonical workload, with 256 requests running, the same kernel
reads at ~2.6 TB/s (``decode_anatomy_h100.json``), while with 14 running it reads at ~3.3. The difference is the
spread of the lengths: the workload's contexts run from ~100 to ~1,100 tokens, and a kernel that gives each
(request, KV head) pair one thread block finishes when the block with the longest context does. The other
blocks' SMs sit idle for the tail.

This benchmark rebuilds the attention call of a decode step at several stages of the canonical workload (the
running requests and their context lengths when 256, 192, 128, ... requests are left) and times ways of cutting
that work:

- ``fi_graph``: what the engine runs: FlashInfer's CUDA-core decode kernel planned by a CUDA-graph wrapper;
- ``fi_graph_sorted``: the same with the longest contexts first in the batch;
- ``fi_plain``: the same kernel, planned without a graph wrapper (it splits only when the batch is small);
- ``fi_tc_graph``: FlashInfer's tensor-core (prefill-style) decode, whose planner cuts every context into
  chunks of one size; ``fi_tc_splitN`` pins that size to N tokens (FlashInfer allows that only without a
  graph wrapper);
- ``fi_chunkN``: the engine's kernel on pieces of at most N tokens, each piece a request of its own, merged
  afterwards by log-sum-exp (the merge's cost included);
- ``fi_holistic``: FlashInfer's persistent ``BatchAttention``, which balances the KV over its blocks itself;
- ``fa3``: FlashAttention-3's paged decode with its own split heuristic;
- ``xqa_pageN``: FlashInfer's XQA decode kernel (from TensorRT-LLM) over the same contexts in pages of N slots;
- ``triton_S_N_W_T``: the ``triton`` backend's split-KV kernel with every context cut into pieces of about ``S``
  tokens (tiles of ``N`` tokens, ``W`` warps, ``T`` pipeline stages), one program per piece and KV head;
- ``allheads_S_N_W_T``: the same split, one program per piece for all KV heads (``benchmarks/decode_allheads.py``);
- ``cuda_C_4_128``: the engine's split-KV CUDA kernel (``minisgl_ref/perf/cuda/split_decode.cu``): pieces of at
  most ``C`` tokens, one block of 128 threads per piece and KV head, 4 rows per half-warp in each of two register
  buffers, the last piece of a context merging them; suffixes: ``_sorted`` puts the longest pieces first in the
  grid, ``_even`` cuts a context into pieces of equal length; ``cudafixed_F_4_128`` always has ``F`` percent more
  pieces than requests (a captured graph's grid is fixed): a piece per context, then the longest piece cut in
  halves, longest first in the grid; ``cudacap_C_4_128`` is the engine's plan: room for an eighth more pieces, a
  piece cut only while it is longer than ``C`` percent of the mean context. (The kernel's builds with 2 rows, 256
  threads or streaming loads, which chapter 11 measured as ``cuda_C_U_T`` and ``_stream``, were removed after those
  measurements; commit e598280 has them.)

With ``--plan-cost`` each stage also times what an engine pays around the kernel when it plans every step
(:func:`plan_cost`): the engine's graph wrapper against the persistent ``BatchAttention``.

Each variant's output is checked against ``fi_graph`` (relative error, bf16) before it is timed. Times are the
median over CUDA-graph replays of 10 calls (``benchmarks.kernels.time_graph``); bandwidth counts the K and V
bytes of every context once. Results go to one JSON file with provenance, rewritten after every stage so that a
run cut short still leaves what it measured. Needs a CUDA device with flashinfer-python (and FA3 for ``fa3``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B's attention
DTYPE = torch.bfloat16
KV_BYTES_PER_TOKEN = 2 * NUM_KV_HEADS * HEAD_DIM * 2  # one layer's K and V of one token, bf16
MARKS = (256, 128, 64, 192, 32, 16)  # the most informative stage first: a run cut short keeps it
SPLITS = (64, 128, 256, 512)
DEVICE = "cuda"  # the index bookkeeping of the runners can be checked on a CPU against stand-in kernels


def canonical_stages(marks: tuple[int, ...] = MARKS, uniform: bool = False) -> dict[str, list[int]]:
    """The running requests' context lengths (new token included) at the first decode step at which at most
    ``mark`` requests are left, in the order the requests were submitted. The schedule is the ideal one the
    roofline assumes: every request admitted before the first decode step, one token per step. With ``uniform``
    each stage is followed by a control stage of the same size whose contexts all have the mean length."""
    from minisgl_ref.bench.workloads import canonical_workload

    work = canonical_workload()
    prompts = [len(p) for p in work.prompts]
    outputs = [sp["max_new_tokens"] for sp in work.sampling_params]
    stages: dict[str, list[int]] = {}
    for mark in marks:
        step = next(t for t in range(max(outputs) + 1) if sum(o > t for o in outputs) <= mark)
        lens = [p + step + 1 for p, o in zip(prompts, outputs) if o > step]
        stages[str(mark)] = lens
        if uniform:  # the control: as many requests and tokens, every context of the mean length
            stages[f"{mark}-uniform"] = [sum(lens) // len(lens)] * len(lens)
    return stages


def generated_tokens(mark: int) -> int:
    """How many tokens each running request has generated at the stage of ``mark`` (see canonical_stages)."""
    from minisgl_ref.bench.workloads import canonical_workload

    outputs = [sp["max_new_tokens"] for sp in canonical_workload().sampling_params]
    return next(t for t in range(max(outputs) + 1) if sum(o > t for o in outputs) <= mark) + 1


class Stage:
    """One layer's KV pool holding ``lens`` contexts (slot 0 unused), and a query each.

    By default each context lies in consecutive slots. With ``generated`` (``--slot-order canonical``) only the
    first ``len - generated`` tokens of each do (its prompt, stored by one prefill); the generated tokens were
    handed out one step at a time to the whole batch, so a request's k-th generated token sits a batch of slots
    after its (k-1)-th, as in the engine's pool with one-token pages."""

    def __init__(self, lens: list[int], seed: int = 0, generated: int | None = None, interleaved: bool = False) -> None:
        gen = torch.Generator(DEVICE).manual_seed(seed)
        self.lens = lens
        total = sum(lens)
        if interleaved:  # a token's K row and V row side by side, 4 KiB in all: k and v are strided views
            kv = torch.randn(total + 1, 2, NUM_KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
            self.k, self.v = kv[:, 0], kv[:, 1]
        else:
            self.k = torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
            self.v = torch.randn(total + 1, NUM_KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
        self.q = torch.randn(len(lens), NUM_Q_HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
        starts, s = [], 1
        for n in lens:
            starts.append(s)
            s += n - (generated or 0)
        self.starts = starts
        self.token_slots = [torch.arange(a, a + n, dtype=torch.int32) for a, n in zip(starts, lens)]
        if generated:
            b = len(lens)
            for i, n in enumerate(lens):
                prompt = n - generated
                self.token_slots[i][prompt:] = s + i + b * torch.arange(generated, dtype=torch.int32)
        self.bytes = total * KV_BYTES_PER_TOKEN

    def slots(self, order: list[int]) -> torch.Tensor:
        return torch.cat([self.token_slots[i] for i in order]).to(DEVICE)


def flashinfer_runner(st: Stage, *, tensor_cores: bool, graph: bool, sort: bool = False,
                      split: int | None = None) -> tuple[Callable[[], torch.Tensor], list[int]]:  # fmt: skip
    """A planned FlashInfer decode call over ``st`` (pages of one token, as the engine shows its pool), and the
    request order it uses."""
    import flashinfer

    b = len(st.lens)
    order = sorted(range(b), key=lambda i: -st.lens[i]) if sort else list(range(b))
    indptr = torch.zeros(b + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor([st.lens[i] for i in order], dtype=torch.int32), 0)
    indices = st.slots(order)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEVICE)
    if graph:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device=DEVICE),
            paged_kv_indices_buffer=torch.zeros(indices.numel(), dtype=torch.int32, device=DEVICE),
            paged_kv_last_page_len_buffer=torch.ones(b, dtype=torch.int32, device=DEVICE),
        )  # fmt: skip
    else:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    kwargs: dict[str, Any] = dict(q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=HEAD_DIM**-0.5)
    if split is not None:
        kwargs["fixed_split_size"] = split
    wrapper.plan(indptr, indices, torch.ones(b, dtype=torch.int32), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 1,
                 **kwargs)  # fmt: skip
    q = st.q[order].contiguous()
    cache = (st.k.unsqueeze(1), st.v.unsqueeze(1))
    return (lambda: wrapper.run(q, cache)), order


def chunked_runner(st: Stage, chunk: int) -> tuple[Callable[[], torch.Tensor], list[int]]:
    """Balance by hand: every context cut into pieces of at most ``chunk`` tokens, each piece a request of its own
    for FlashInfer's CUDA-core decode (with the query of its request), and the pieces' partial results merged by
    their log-sum-exp (``flashinfer.merge_states``). With ~1,000 pieces x 8 KV heads the grid is several waves, so
    the GPU hands a block to an SM as soon as it frees one: no SM waits for another's long context."""
    import flashinfer

    b = len(st.lens)
    pieces = [(i, s, min(chunk, n - s)) for i, n in enumerate(st.lens) for s in range(0, n, chunk)]
    indptr = torch.zeros(len(pieces) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor([n for _, _, n in pieces], dtype=torch.int32), 0)
    indices = torch.cat([st.token_slots[i][s : s + n] for i, s, n in pieces]).to(DEVICE)
    owner = torch.tensor([i for i, _, _ in pieces], device=DEVICE)
    # table[r, j]: the j-th piece of request r, or the padding state (index len(pieces): weight 0) past its last
    width = max(-(-n // chunk) for n in st.lens)
    table = torch.full((b, width), len(pieces), dtype=torch.int64)
    for j, (i, s, _) in enumerate(pieces):
        table[i, s // chunk] = j
    table = table.to(DEVICE)
    pad_o = torch.zeros(1, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    pad_lse = torch.full((1, NUM_Q_HEADS), float("-inf"), dtype=torch.float32, device=DEVICE)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    wrapper.plan(indptr, indices, torch.ones(len(pieces), dtype=torch.int32), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM,
                 1, q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=HEAD_DIM**-0.5)  # fmt: skip
    cache = (st.k.unsqueeze(1), st.v.unsqueeze(1))

    def call() -> torch.Tensor:
        o, lse = wrapper.run(st.q.index_select(0, owner), cache, return_lse=True)
        o, lse = torch.cat([o, pad_o]), torch.cat([lse.float(), pad_lse])
        merged, _ = flashinfer.merge_states(o[table], lse[table])
        return merged

    return call, list(range(b))


def holistic_runner(st: Stage) -> tuple[Callable[[], torch.Tensor], list[int]]:
    """FlashInfer's persistent ``BatchAttention``: its planner cuts the whole batch's KV into pieces of similar
    size and hands them to a fixed set of blocks, one per SM slot, whatever the length of each context."""
    import flashinfer

    b = len(st.lens)
    kv_indptr = torch.zeros(b + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(st.lens, dtype=torch.int32), 0)
    wrapper = flashinfer.BatchAttention("NHD")
    wrapper.plan(torch.arange(b + 1, dtype=torch.int32).to(DEVICE), kv_indptr.to(DEVICE),
                 st.slots(list(range(b))), torch.tensor(st.lens, dtype=torch.int32).to(DEVICE), NUM_Q_HEADS,
                 NUM_KV_HEADS, HEAD_DIM, HEAD_DIM, 1, causal=False, sm_scale=HEAD_DIM**-0.5,
                 q_data_type=DTYPE, kv_data_type=DTYPE)  # fmt: skip
    cache = (st.k.unsqueeze(1), st.v.unsqueeze(1))

    def run() -> torch.Tensor:
        return wrapper.run(st.q, cache)[0]

    run.wrapper = wrapper  # type: ignore[attr-defined]  # with_matmuls reads its plan's workspace
    return run, list(range(b))


def fa3_runner(st: Stage) -> tuple[Callable[[], torch.Tensor], list[int]]:
    import flash_attn_interface as fa

    b, width = len(st.lens), max(st.lens)
    table = torch.zeros(b, width, dtype=torch.int32)
    for i, n in enumerate(st.lens):
        table[i, :n] = st.token_slots[i]
    table = table.to(DEVICE)
    seqlens = torch.tensor(st.lens, dtype=torch.int32, device=DEVICE)
    q = st.q.unsqueeze(1)
    k, v = st.k.view(-1, 1, NUM_KV_HEADS, HEAD_DIM), st.v.view(-1, 1, NUM_KV_HEADS, HEAD_DIM)

    def call() -> torch.Tensor:
        out = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, page_table=table,
                                         softmax_scale=HEAD_DIM**-0.5, causal=True)  # fmt: skip
        return (out[0] if isinstance(out, tuple) else out).view(b, NUM_Q_HEADS, HEAD_DIM)

    return call, list(range(b))


def triton_runner(st: Stage, split_len: int = 128, block_n: int = 64, warps: int = 4,
                  stages: int = 2, allheads: bool = False) -> tuple[Callable[[], torch.Tensor], list[int]]:  # fmt: skip
    """The ``triton`` backend's split-KV decode kernel with every context cut into pieces of about ``split_len``
    tokens (as many splits as the longest context needs), so that its ~1,000 pieces x 8 KV heads balance the
    work over the SMs the way the persistent kernel's planner does, then merged by a second kernel."""
    from minisgl_ref.attention.triton_kernels.decode_attention import decode_attention_fwd

    b = len(st.lens)
    indptr = torch.zeros(b + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(st.lens, dtype=torch.int32), 0)
    indptr = indptr.to(DEVICE)
    indices = st.slots(list(range(b)))
    max_splits = -(-max(st.lens) // split_len)
    mid_o = torch.empty(b, NUM_Q_HEADS, max_splits, HEAD_DIM, dtype=torch.float32, device=DEVICE)
    mid_lse = torch.empty(b, NUM_Q_HEADS, max_splits, dtype=torch.float32, device=DEVICE)
    out = torch.empty_like(st.q)

    if allheads:
        from benchmarks.decode_allheads import allheads_decode as decode_attention_fwd  # noqa: F811

    def call() -> torch.Tensor:
        decode_attention_fwd(st.q, st.k, st.v, out, indptr, indices, mid_o, mid_lse, HEAD_DIM**-0.5, max_splits,
                             min_split_len=split_len, block_n=block_n, num_warps=warps, num_stages=stages)  # fmt: skip
        return out

    return call, list(range(b))


def xqa_runner(st: Stage, page_size: int) -> tuple[Callable[[], torch.Tensor], list[int]]:
    """FlashInfer's XQA decode kernel (TensorRT-LLM's, for grouped-query attention; pages of 16 to 128 tokens).
    The stage's contexts are copied into pages of ``page_size`` slots, the pages dealt out in a shuffled order as
    a pool would hand them out, so the kernel reads the same K and V as the others."""
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    b = len(st.lens)
    npages = [-(-n // page_size) for n in st.lens]
    gen = torch.Generator().manual_seed(len(st.lens))
    order = torch.randperm(sum(npages), generator=gen).to(torch.int32) + 1  # page 0 unused
    table = torch.zeros(b, max(npages), dtype=torch.int32)
    dest, start = [], 0
    for i, n in enumerate(st.lens):
        pages = order[start : start + npages[i]]
        table[i, : npages[i]] = pages
        start += npages[i]
        pos = torch.arange(n)
        dest.append(pages[pos // page_size].long() * page_size + pos % page_size)
    dest_t = torch.cat(dest).to(DEVICE)
    src = st.slots(list(range(b))).long()
    shape = (sum(npages) + 1, page_size, NUM_KV_HEADS, HEAD_DIM)
    k = torch.zeros(shape, dtype=DTYPE, device=DEVICE)
    v = torch.zeros(shape, dtype=DTYPE, device=DEVICE)
    k.view(-1, NUM_KV_HEADS, HEAD_DIM)[dest_t] = st.k[src]
    v.view(-1, NUM_KV_HEADS, HEAD_DIM)[dest_t] = st.v[src]
    table = table.to(DEVICE)
    seq_lens = torch.tensor(st.lens, dtype=torch.int32, device=DEVICE)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEVICE)
    out = torch.empty_like(st.q)
    max_len = max(npages) * page_size

    def call() -> torch.Tensor:
        return xqa_batch_decode_with_kv_cache(st.q, (k, v), ws, table, seq_lens, max_len,
                                              bmm1_scale=HEAD_DIM**-0.5, out=out)  # fmt: skip

    return call, list(range(b))


def split_decode_runner(st: Stage, name: str) -> tuple[Callable[[], torch.Tensor], list[int]]:
    """``cuda_C_U_T`` with any of the suffixes ``_sorted``, ``_even`` (see the module docstring);
    ``cudafixed_F_U_T``: ``F`` percent more pieces than requests, whatever their lengths; ``cudacap_C_U_T``: room
    for an eighth more, cut only while a piece is longer than ``C`` percent of the mean context;
    ``cudaocc4``: the engine's plan and variant compiled so that four blocks fit an SM (at most 128 registers)."""
    from benchmarks.split_decode import runner

    if name == "cudaocc4":
        return runner(st, 1, 4, 128, fixed=0.125, split_above=2.0, min_blocks=4)
    fields = name.split("_")
    chunk, unroll, threads = (int(x) for x in fields[1:4])
    if fields[0] == "cudafixed":
        return runner(st, 1, unroll, threads, fixed=chunk / 100)
    if fields[0] == "cudacap":  # the engine's plan: room for 12.5% more pieces, cut above chunk% of the mean
        return runner(st, 1, unroll, threads, fixed=0.125, split_above=chunk / 100)
    return runner(st, chunk, unroll, threads, longest_first="sorted" in fields, even="even" in fields)


def variants() -> dict[str, Callable[[Stage], tuple[Callable[[], torch.Tensor], list[int]]]]:
    """Every variant by name, the engine's own first (the others' errors are measured against it)."""
    v: dict[str, Callable[[Stage], tuple[Callable[[], torch.Tensor], list[int]]]] = {
        "fi_graph": lambda st: flashinfer_runner(st, tensor_cores=False, graph=True),
        "fi_tc_graph": lambda st: flashinfer_runner(st, tensor_cores=True, graph=True),
    }
    v["fi_graph_sorted"] = lambda st: flashinfer_runner(st, tensor_cores=False, graph=True, sort=True)
    for n in (128, 256, 512):
        v[f"fi_chunk{n}"] = lambda st, n=n: chunked_runner(st, n)
    for n in SPLITS:  # FlashInfer pins a split size only outside CUDA graphs
        v[f"fi_tc_split{n}"] = lambda st, n=n: flashinfer_runner(st, tensor_cores=True, graph=False, split=n)
    v["fi_holistic"] = holistic_runner
    v["fa3"] = fa3_runner
    v["fi_plain"] = lambda st: flashinfer_runner(st, tensor_cores=False, graph=False)
    for n in (16, 32, 64, 128):
        v[f"xqa_page{n}"] = lambda st, n=n: xqa_runner(st, n)
    # triton_S_N_W_T: pieces of S tokens, blocks of N tokens, W warps, T pipeline stages
    for s_, n_, w_, t_ in ((128, 64, 4, 2), (256, 64, 4, 2), (128, 32, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3),
                           (256, 64, 4, 3), (256, 128, 8, 2), (512, 64, 4, 3)):
        v[f"triton_{s_}_{n_}_{w_}_{t_}"] = lambda st, a=(s_, n_, w_, t_): triton_runner(st, *a)
    for s_ in (64, 128, 256):
        for n_ in (8, 16, 32):
            for w_ in (4, 8):
                for t_ in (2, 3):
                    v[f"allheads_{s_}_{n_}_{w_}_{t_}"] = lambda st, a=(s_, n_, w_, t_): triton_runner(st, *a, allheads=True)
    # cuda_C_4_128[_sorted][_even]: the engine's split-KV CUDA kernel (minisgl_ref/perf/cuda/split_decode.cu)
    for c_ in (256, 512, 768, 1024):
        for extra in ("", "_sorted", "_even", "_sorted_even"):
            name = f"cuda_{c_}_4_128{extra}"
            v[name] = lambda st, n=name: split_decode_runner(st, n)
    for f_ in (0, 12, 25, 50, 100):  # cudafixed_F_4_128: a fixed count of pieces, F percent more than requests
        name = f"cudafixed_{f_}_4_128"
        v[name] = lambda st, n=name: split_decode_runner(st, n)
    for c_ in (150, 200, 300):  # cudacap_C_4_T: cut a piece only while it is over C% of the mean context
        name = f"cudacap_{c_}_4_128"
        v[name] = lambda st, n=name: split_decode_runner(st, n)
    v["cudaocc4"] = lambda st: split_decode_runner(st, "cudaocc4")
    return v


def measure_stage(st: Stage, names: list[str], repeats: int, others: list[Stage] | None = None) -> list[dict[str, Any]]:
    """Time each variant on ``st``. With ``others`` (stages of the same lengths, their own KV), each timed call
    runs the variant on ``st`` and then on every one of them, as a decode step runs it on every layer's cache:
    the time is per layer, and no layer finds its KV left in the L2 cache by the call before."""
    from benchmarks.kernels import time_graph

    rows, ref = [], None
    for name in names:
        row: dict[str, Any] = {"variant": name}
        try:
            fn, order = variants()[name](st)
            out = torch.empty_like(st.q)
            out[torch.tensor(order, device=DEVICE)] = fn().view_as(st.q)
            torch.cuda.synchronize()
            if ref is None:
                ref = out.float()
            row["rel_error_vs_first"] = float((out.float() - ref).norm() / ref.norm())
            layers = [fn] + [variants()[name](o)[0] for o in (others or [])]
            seconds, method = time_graph(lambda: [f() for f in layers], calls_per_graph=1 if others else 10,  # noqa: B023
                                         repeats=repeats)
            seconds /= len(layers)
            row.update(time_us=round(seconds * 1e6, 2), timing=method,
                       bandwidth_GBps=round(st.bytes / seconds / 1e9, 1))  # fmt: skip
        except Exception as e:  # one variant failing must not lose the others' numbers
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
        print(f"  {name:<22} {row.get('time_us', 'ERR'):>9} us  {row.get('bandwidth_GBps', ''):>7} GB/s  "
              f"err {row.get('rel_error_vs_first', float('nan')):.1e}  {row.get('error', '')}", flush=True)
    return rows


#: A Qwen3-0.6B layer's matrix multiplies in a decode step: (output, input) features of qkv, o, gate_up, down.
LAYER_MATMULS = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))


def with_matmuls(st: Stage, others: list[Stage], name: str, repeats: int) -> dict[str, Any]:
    """The attention of every layer as a decode step meets it: each layer's call followed by that layer's four
    matrix multiplies (their own weights, one row per request). Times the whole chain and the multiplies alone
    with CUDA events, and the attention kernels inside the chain with the profiler: if the attention reads as
    fast between multiplies as it does back to back, the multiplies' neighbourhood costs it nothing."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.kernels import time_graph

    rows = len(st.lens)
    attn = [variants()[name](x)[0] for x in [st, *others]]
    weights = [[torch.randn(o, i, device=DEVICE, dtype=DTYPE) * 0.02 for o, i in LAYER_MATMULS] for _ in attn]
    inputs = {i: torch.randn(rows, i, device=DEVICE, dtype=DTYPE) for _, i in LAYER_MATMULS}

    def matmuls(layer: int) -> None:
        for w in weights[layer]:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    def chain() -> None:
        for layer, f in enumerate(attn):
            f()
            matmuls(layer)

    def attention_only() -> None:
        for f in attn:
            f()

    def profiled_attention_us(fn: Callable[[], None], replays: int = 5, longer_than_us: float = 0.0) -> float:
        """GPU time of the attention kernels per layer in replays of a graph of ``fn``, from the profiler (only
        kernels longer than ``longer_than_us``: leaves out a tiny call of the same kernel)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        names = ("Attention", "Persistent", "BatchDecode", "MergeStates", "_decode_stage", "_allheads", "xqa", "kernel_mha",
                 "split_decode")
        us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and any(k in e.name for k in names) and e.time_range.elapsed_us() > longer_than_us)  # fmt: skip
        return us / replays / len(attn)

    # A control for the matmuls' effect: a plain 64 MB copy between the layers replaces the L2 cache's content as
    # the multiplies do, without their arithmetic (or their power draw).
    src = torch.empty(64 << 20, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)

    def with_copies() -> None:
        for f in attn:
            f()
            dst.copy_(src)

    # Two more: one tiny kernel between the layers (an elementwise add on one number: a kernel boundary and nothing
    # else), and one tiny matrix multiply (16 x 16, its weights 512 bytes: a cuBLAS kernel without the traffic).
    one = torch.zeros(1, device=DEVICE)
    small_a = torch.randn(16, 16, device=DEVICE, dtype=DTYPE)

    def with_tiny_kernel() -> None:
        for f in attn:
            f()
            one.add_(1.0)

    def with_tiny_matmul() -> None:
        for f in attn:
            f()
            torch.mm(small_a, small_a)

    # And: the matmuls, then the same attention kernel on a one-request batch (its code runs, almost no data is
    # read), then the layer's attention. If what the multiplies evict is the kernel's own code, this gets it back.
    tiny_attention = variants()[name](Stage([16], seed=99))[0]

    def chain_code_warm() -> None:
        for layer, f in enumerate(attn):
            tiny_attention()
            f()
            matmuls(layer)

    # Another: the matmuls, then the attention's plan (its integer workspace) read once into the L2 cache.
    plans = [getattr(f, "wrapper", None) for f in attn]
    sink = torch.empty((), dtype=torch.int64, device=DEVICE)

    def chain_warm_plan() -> None:
        for layer, f in enumerate(attn):
            w = plans[layer]
            if w is not None:
                torch.sum(w.int_workspace_buffer.view(torch.int32), dim=0, out=sink)
            f()
            matmuls(layer)

    total, _ = time_graph(chain, calls_per_graph=1, repeats=repeats)
    mm_only, _ = time_graph(lambda: [matmuls(layer) for layer in range(len(attn))], calls_per_graph=1, repeats=repeats)
    alone, between = profiled_attention_us(attention_only), profiled_attention_us(chain)
    between_copies = profiled_attention_us(with_copies)
    between_tiny, between_tiny_mm = profiled_attention_us(with_tiny_kernel), profiled_attention_us(with_tiny_matmul)
    code_warm = profiled_attention_us(chain_code_warm, longer_than_us=30.0)
    warm_plan = profiled_attention_us(chain_warm_plan) if plans[0] is not None else None
    return {"variant": f"{name}_with_matmuls", "layers": len(attn),
            "chain_us_per_layer": round(total * 1e6 / len(attn), 2),
            "matmuls_us_per_layer": round(mm_only * 1e6 / len(attn), 2),
            "attention_us_per_layer_profiled_alone": round(alone, 2),
            "attention_us_per_layer_profiled_between_matmuls": round(between, 2),
            "attention_us_per_layer_profiled_between_64mb_copies": round(between_copies, 2),
            "attention_us_per_layer_profiled_between_tiny_kernels": round(between_tiny, 2),
            "attention_us_per_layer_profiled_between_tiny_matmuls": round(between_tiny_mm, 2),
            "attention_us_per_layer_profiled_between_matmuls_after_a_one_request_call": round(code_warm, 2),
            "attention_us_per_layer_profiled_between_matmuls_plan_read_first": None if warm_plan is None
            else round(warm_plan, 2),
            "attention_bandwidth_GBps_profiled_alone": round(st.bytes / (alone * 1e-6) / 1e9, 1),
            "attention_bandwidth_GBps_profiled_between_matmuls": round(st.bytes / (between * 1e-6) / 1e9, 1)}


def plan_cost(st: Stage, repeats: int = 30) -> dict[str, dict[str, float]]:
    """What a decode step pays around the kernel when it plans anew, as an engine must (the lengths change every
    step): for the engine's graph wrapper and for the persistent ``BatchAttention``, the host time of one plan
    and the GPU time of plan upload + one graph replay of the kernel, against the replay alone."""
    import flashinfer

    b = len(st.lens)
    indptr_cpu = torch.zeros(b + 1, dtype=torch.int32, pin_memory=True)
    indptr_cpu[1:] = torch.cumsum(torch.tensor(st.lens, dtype=torch.int32), 0)
    indices = st.slots(list(range(b)))
    cache = (st.k.unsqueeze(1), st.v.unsqueeze(1))
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEVICE)
    paged = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device=DEVICE),
        paged_kv_indices_buffer=torch.zeros(indices.numel(), dtype=torch.int32, device=DEVICE),
        paged_kv_last_page_len_buffer=torch.ones(b, dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    last = torch.ones(b, dtype=torch.int32, pin_memory=True)
    kw = dict(q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=HEAD_DIM**-0.5)

    def plan_paged() -> None:
        paged.plan(indptr_cpu, indices, last, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 1, **kw)

    persistent = flashinfer.BatchAttention("NHD")
    qo = torch.arange(b + 1, dtype=torch.int32)
    lens = torch.tensor(st.lens, dtype=torch.int32)
    persistent.plan(qo, indptr_cpu, indices, lens, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM, 1,
                    causal=False, **kw)  # fmt: skip

    def plan_persistent() -> None:  # the planner itself, without the wrapper's device-wide synchronize
        w = persistent
        w.module.plan(w.float_workspace_buffer, w.int_workspace_buffer, w.page_locked_int_workspace_buffer, qo,
                      indptr_cpu, lens, b, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, False)  # fmt: skip

    out: dict[str, dict[str, float]] = {}
    for name, plan, run in (("fi_graph", plan_paged, lambda: paged.run(st.q, cache)),
                            ("fi_holistic", plan_persistent, lambda: persistent.run(st.q, cache)[0])):
        plan()
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        host, gpu, alone = [], [], []
        for _ in range(repeats):
            torch.cuda.synchronize()
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            t = time.perf_counter()
            plan()
            host.append(time.perf_counter() - t)
            e1.record()
            graph.replay()
            e2.record()
            e2.synchronize()
            gpu.append(e0.elapsed_time(e2))
            alone.append(e1.elapsed_time(e2))
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        out[name] = {"plan_host_us": round(med(host) * 1e6, 1), "plan_and_kernel_gpu_us": round(med(gpu) * 1e3, 1),
                     "kernel_after_plan_gpu_us": round(med(alone) * 1e3, 1)}  # fmt: skip
        print(f"  {name:<12} plan on the host {out[name]['plan_host_us']:>7} us, GPU plan upload + kernel "
              f"{out[name]['plan_and_kernel_gpu_us']:>7} us (kernel {out[name]['kernel_after_plan_gpu_us']} us)",
              flush=True)
    return out


def warm(tensor_cores: bool) -> None:
    """Build (or load from FlashInfer's disk cache) one decode kernel family, on a tiny batch: a script runs the
    two families' compilations side by side before timing anything."""
    st = Stage([5, 7])
    flashinfer_runner(st, tensor_cores=tensor_cores, graph=False)[0]()
    torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_balance", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="JSON file, rewritten after every stage")
    p.add_argument("--variants", default=",".join(variants()), help="comma-separated, the reference first")
    p.add_argument("--marks", default=",".join(map(str, MARKS)))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--uniform", action="store_true", help="add a control stage of equal lengths after each")
    p.add_argument("--warmup-s", type=float, default=3.0, help="keep the GPU busy this long before timing")
    p.add_argument("--plan-cost", action="store_true", help="also time re-planning every step (plan_cost)")
    p.add_argument("--with-matmuls", action="store_true",
                   help="with --layers: also run each layer's matrix multiplies after its attention (with_matmuls)")
    p.add_argument("--slot-order", choices=("contiguous", "canonical"), default="contiguous",
                   help="canonical: each prompt in a run of slots, generated tokens a batch of slots apart")
    p.add_argument("--kv-layout", choices=("separate", "interleaved"), default="separate",
                   help="interleaved: each token's K and V rows side by side in one tensor (FlashInfer's combined "
                        "paged layout) instead of a K tensor and a V tensor")
    p.add_argument("--layers", type=int, default=1,
                   help="time each call over this many caches of the same lengths, one after another (a decode "
                        "step's layers); 1 reruns one cache, which the L2 cache partly holds between calls")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise ValueError("benchmarks.decode_balance needs a CUDA device")
    from benchmarks.kernels import copy_bandwidth
    from minisgl_ref.bench.provenance import collect_provenance, package_version

    names = [n for n in args.variants.split(",") if n]
    stages = canonical_stages(tuple(int(m) for m in args.marks.split(",")), args.uniform)
    t0 = time.perf_counter()
    copy_bw = copy_bandwidth(nbytes=1 << 30, warmup_s=args.warmup_s)  # an idle GPU starts at a low clock
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
    result: dict[str, Any] = {
        "benchmark": "decode_balance",
        "what": "one layer's decode attention at stages of the canonical workload (Qwen3-0.6B attention: 16 query "
                "heads, 8 KV heads, head dim 128, bf16; pages of one token; contexts in consecutive slots)",
        "copy_bandwidth_GBps": round(copy_bw / 1e9, 1),
        "layers": args.layers,
        "slot_order": args.slot_order,
        "kv_layout": args.kv_layout,
        "stages": [],
        "provenance": collect_provenance(variants=names, repeats=args.repeats, layers=args.layers, slot_order=args.slot_order,
                                         kernel_packages={
            n: package_version(n) for n in ("flashinfer-python", "tokenspeed-fa3")}),
    }  # fmt: skip
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    for mark, lens in stages.items():
        print(f"{len(lens)} running, {sum(lens):,} context tokens, lengths {min(lens)}..{max(lens)}", flush=True)
        gen = generated_tokens(int(mark)) if args.slot_order == "canonical" and mark.isdigit() else None
        st = Stage(lens, seed=len(lens), generated=gen, interleaved=args.kv_layout == "interleaved")
        others = [Stage(lens, seed=len(lens) + i, generated=gen, interleaved=args.kv_layout == "interleaved")
                  for i in range(1, args.layers)]
        rows = measure_stage(st, names, args.repeats, others)
        if args.with_matmuls and others:
            extra_rows = [with_matmuls(st, others, n, args.repeats) for n in names]
            for r in extra_rows:
                print(f"  with matmuls: {r}", flush=True)
            rows += extra_rows
        del others
        extra = {"plan_cost": plan_cost(st)} if args.plan_cost else {}
        result["stages"].append({**extra, "stage": mark, "running": len(lens), "context_tokens": sum(lens),
                                 "min_len": min(lens), "max_len": max(lens), "kv_bytes": st.bytes,
                                 "kv_floor_us_at_copy_bw": round(st.bytes / copy_bw * 1e6, 2), "variants": rows})  # fmt: skip
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(result, indent=1) + "\n")
        del st
        torch.cuda.empty_cache()
    end_bw = copy_bandwidth(nbytes=1 << 30, warmup_s=0.5)
    result["copy_bandwidth_GBps_end"] = round(end_bw / 1e9, 1)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"copy bandwidth at the end {end_bw / 1e9:.0f} GB/s")
    print(f"\n{'stage':>11} " + " ".join(f"{n.removeprefix('fi_')[:10]:>10}" for n in names) + "   (GB/s)")
    for s in result["stages"]:
        bw = {r["variant"]: r.get("bandwidth_GBps", 0.0) for r in s["variants"]}
        print(f"{s['stage']:>11} " + " ".join(f"{bw.get(n, 0.0):>10.0f}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
