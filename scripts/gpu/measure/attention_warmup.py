"""Compile FlashInfer's JIT kernels for every (dtype, head dim, kernel) the attention tests and benchmark use,
in parallel processes, before pytest starts (chapter 07's GPU script).

FlashInfer compiles each kernel family with nvcc on first use (~25 s each) and caches the result on disk. Run
one after the other inside pytest that is minutes of a short GPU lease; run here side by side it is about one
compile's time. Also prints what the machine has (GPU, versions, FA3 importable).
"""

from __future__ import annotations

import itertools
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def build(args: tuple[str, int, str]) -> str:
    import torch

    from minisgl_ref.attention.flashinfer_backend import FlashInferBackend
    from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
    from minisgl_ref.kvcache.pool import KVPool
    from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
    from minisgl_ref.layers.attention import AttentionLayer

    dtype_name, head_dim, kind = args
    dtype = getattr(torch, dtype_name)
    t0 = time.time()
    kv_heads, gqa = (2, 4) if kind == "decode_tc" else (4, 2)
    pool = KVPool(1, 64, kv_heads, head_dim, dtype, "cuda")
    table = ReqToTokenPool(2, 32, "cuda")
    table.table[0, :8] = torch.arange(1, 9, dtype=torch.int32)
    decode = kind != "prefill"
    n = 1 if decode else 8
    batch = ForwardBatch(mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
                         input_ids=torch.zeros(n, dtype=torch.int64, device="cuda"),
                         positions=torch.zeros(n, dtype=torch.int64, device="cuda"),
                         extend_lens_cpu=[n], prefix_lens_cpu=[8 - n], attn_backend=None,  # type: ignore[arg-type]
                         req_pool_indices=torch.zeros(1, dtype=torch.int64, device="cuda"),
                         out_cache_loc=torch.arange(9 - n, 9, device="cuda"))
    backend = FlashInferBackend(pool, table, num_q_heads=kv_heads * gqa)
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    q = torch.randn(n, kv_heads * gqa, head_dim, dtype=dtype, device="cuda")
    k = torch.randn(n, kv_heads, head_dim, dtype=dtype, device="cuda")
    backend.forward(q, k, k.clone(), AttentionLayer(0, kv_heads * gqa, kv_heads, head_dim), batch)
    torch.cuda.synchronize()
    return f"{dtype_name} d{head_dim} {kind}: {time.time() - t0:.1f}s"


def main() -> int:
    import torch

    print("GPU:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    for mod in ("triton", "flashinfer", "flash_attn_interface", "flash_attn"):
        try:
            m = __import__(mod)
            print(f"{mod}: {getattr(m, '__version__', 'importable')}")
        except Exception as e:  # noqa: BLE001 - a probe: report whatever goes wrong
            print(f"{mod}: NOT importable ({type(e).__name__}: {e})")
    jobs = list(itertools.product(["bfloat16", "float16"], [64, 128], ["decode", "decode_tc", "prefill"]))
    if len(sys.argv) > 1 and sys.argv[1] == "bench":  # only what the benchmark needs
        jobs = [("bfloat16", 128, k) for k in ("decode", "decode_tc", "prefill")]
    t0 = time.time()
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=len(jobs), mp_context=mp.get_context("spawn")) as pool:
        for line in pool.map(build, jobs):
            print("  built", line)
    print(f"flashinfer warm-up: {time.time() - t0:.1f}s for {len(jobs)} kernel families")
    return 0


if __name__ == "__main__":
    sys.exit(main())
