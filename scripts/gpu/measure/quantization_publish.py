"""Turn the raw files of scripts/gpu/measure/quantization.sh into the data files chapters 14 and 15 cite.

    python3 scripts/gpu/measure/quantization_publish.py fp8 RUN_DIR [RUN_DIR ...]   # -> docs/data/fp8_*_h200.json
    python3 scripts/gpu/measure/quantization_publish.py moe RUN_DIR [RUN_DIR ...]   # -> docs/data/moe_*_h200.json

Each RUN_DIR is one device run's $OUT. ``fp8``: the canonical workload by variant and round
(``fp8_canonical_<variant>_<round>.json``, bench offline's files) and the decode step times
(``quant_steps_<label>.json``). ``moe``: Qwen3-30B-A3B's canonical run with its routing counted (bench offline's
file, as it is) and the fused kernel against the reference loop (``moe_endtoend.json``). Every row keeps the
provenance of the file it came from; the pytest summaries found in the run directories go along
(``gpu_tests*.txt``), with ``PUBLISH_NOTE`` (an environment variable) as a note on them where set.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[3] / "docs" / "data"
CANONICAL_KEYS = ("output_throughput", "wall_s", "roofline_floor_s", "roofline_fraction", "kv_bytes_per_decode_step",
                  "startup_s", "steps", "output_tokens", "input_tokens")


def _tests(dirs: list[Path]) -> list[dict]:
    out = []
    for d in dirs:
        for log in sorted(d.glob("gpu_tests*.txt")):
            lines = [ln.strip("= ") for ln in log.read_text().splitlines() if re.search(r"\d+ (passed|failed)", ln)]
            failed = [ln.split(" ", 1)[1] for ln in log.read_text().splitlines() if ln.startswith("FAILED ")]
            if lines:
                out.append({"file": log.name, "run": d.name, "summary": lines[-1], "failed": failed})
    return out


def fp8(dirs: list[Path]) -> None:
    rows = []
    for d in dirs:
        for f in sorted(d.glob("fp8_canonical_*_*.json")):
            variant, round_ = re.match(r"fp8_canonical_(.+)_(cold|warm)\.json", f.name).groups()  # type: ignore[union-attr]
            data = json.loads(f.read_text())
            r = data["results"][0]
            rows.append({"variant": variant, "round": round_, **{k: r.get(k) for k in CANONICAL_KEYS},
                         "engine_args": {k: r["engine_args"].get(k) for k in ("kv_cache_dtype", "attention_backend")},
                         "provenance": data["provenance"]})
    note = os.environ.get("PUBLISH_NOTE")
    canonical = {"what": "the canonical offline workload (256 requests) on Qwen3-0.6B with dummy weights, bf16 "
                         "against FP8 projections (fp8: 128-column groups, Triton kernel; w8a8_fp8: per channel, "
                         "torch._scaled_mm), an FP8 KV cache (fp8_e4m3) and both; one fresh process per run, cold: "
                         "the first round on the machine, warm: a repeat with the compile caches filled; each "
                         "run's floor from its own stored bytes at the measured bandwidth",
                 "bandwidth": 4.278e12, "rows": rows, "gpu_tests": _tests(dirs),
                 **({"gpu_tests_note": note} if note else {})}
    (DATA / "fp8_canonical_h200.json").write_text(json.dumps(canonical, indent=1) + "\n")
    steps = {}
    for d in dirs:
        for f in sorted(d.glob("quant_steps_*.json")):
            steps[f.stem.removeprefix("quant_steps_")] = json.loads(f.read_text())
    if steps:
        (DATA / "fp8_decode_steps_h200.json").write_text(json.dumps(
            {"what": "decode step times (CUDA graph replay) against each step's floor: 'kv', Qwen3-0.6B at 64 and "
                     "256 requests of 1,024 tokens with a bf16 cache (default decode kernels; FlashInfer's alone) "
                     "and an FP8 cache; 'weights', Qwen3-14B at 1, 16 and 64 requests of 512 tokens with bf16 "
                     "and FP8 projections", **steps}, indent=1) + "\n")
    print(f"wrote fp8_canonical_h200.json ({len(rows)} runs) and fp8_decode_steps_h200.json ({', '.join(steps)})")


def moe(dirs: list[Path]) -> None:
    """bench offline's file of the counted canonical run, as it is; the fused-against-reference file with the
    GPU test summaries added."""
    for d in dirs:
        f = d / "moe_canonical_qwen3_30b_a3b.json"
        if f.exists():
            (DATA / "moe_canonical_h200.json").write_text(f.read_text())
            print("wrote moe_canonical_h200.json")
        f = d / "moe_endtoend.json"
        if f.exists():
            data = json.loads(f.read_text())
            data["gpu_tests"] = _tests(dirs)
            (DATA / "moe_endtoend_h200.json").write_text(json.dumps(data, indent=1) + "\n")
            print("wrote moe_endtoend_h200.json")


if __name__ == "__main__":
    kind, *paths = sys.argv[1:]
    {"fp8": fp8, "moe": moe}[kind]([Path(p) for p in paths])
