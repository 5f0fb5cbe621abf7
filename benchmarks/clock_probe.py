"""``python -m benchmarks.clock_probe OUT.json``: do the decode attention kernels run at another clock when the
layer's matrix multiplies sit between them? (chapter 11)

The 28 layers' attention at the first decode stage of the canonical workload (256 running), alone, between each
layer's four multiplies, and between 64 MB copies, each chain a CUDA graph replayed for 3 s while ``nvidia-smi``
samples the SM clock, the power draw and the active throttle reasons every 50 ms. Needs a CUDA device.
"""

import json
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.decode_balance import DEVICE, DTYPE, LAYER_MATMULS, Stage, canonical_stages, generated_tokens, variants
from benchmarks.kernels import copy_bandwidth
from minisgl_ref.bench.provenance import collect_provenance, package_version

out = sys.argv[1]
copy_bandwidth(nbytes=1 << 30, warmup_s=2)
res: dict = {"provenance": collect_provenance(kernel_packages={"flashinfer-python": package_version("flashinfer-python")})}
for mark, name in ((256, "fi_holistic"), (256, "fi_graph")):
    lens = canonical_stages((mark,))[str(mark)]
    gen = generated_tokens(mark)
    sts = [Stage(lens, seed=len(lens) + i, generated=gen) for i in range(28)]
    attn = [variants()[name](s)[0] for s in sts]
    weights = [[torch.randn(o, i, device=DEVICE, dtype=DTYPE) * 0.02 for o, i in LAYER_MATMULS] for _ in attn]
    xs = {i: torch.randn(len(lens), i, device=DEVICE, dtype=DTYPE) for _, i in LAYER_MATMULS}
    src = torch.empty(64 << 20, dtype=torch.uint8, device=DEVICE); dst = torch.empty_like(src)
    def alone() -> None:
        for f in attn:  # noqa: B023
            f()

    def mm() -> None:
        for layer, f in enumerate(attn):  # noqa: B023
            f()
            for w in weights[layer]:  # noqa: B023
                torch.nn.functional.linear(xs[w.shape[1]], w)  # noqa: B023

    def cp() -> None:
        for f in attn:  # noqa: B023
            f()
            dst.copy_(src)  # noqa: B023

    for label, fn in (("alone", alone), ("matmuls", mm), ("copies", cp), ("alone2", alone)):
        fn(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay(); torch.cuda.synchronize()
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                                "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
        t0 = time.time(); n = 0
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        while time.time() - t0 < 3.0:
            for _ in range(20): g.replay()
            n += 20
            torch.cuda.synchronize()
        e.record(); e.synchronize()
        smi.terminate(); lines = smi.communicate()[0].strip().splitlines()
        rows = [l.split(", ") for l in lines[5:]]
        sm = [float(r[0]) for r in rows]; pw = [float(r[2]) for r in rows]
        res[f"{name}_{label}"] = dict(us_per_layer=round(s.elapsed_time(e) * 1e3 / n / 28, 2), sm_clock_mhz=statistics.mean(sm),
                                      sm_clock_min=min(sm), power_w=statistics.mean(pw), mem_clock=rows[0][1], temp=rows[-1][3], throttle=sorted(set(r[4] for r in rows)))
        print(name, label, res[f"{name}_{label}"], flush=True)
    del sts, attn
    torch.cuda.empty_cache()
json.dump(res, open(out, "w"), indent=1)
