"""Merge the GPU test run's results into the kernel benchmark's JSON (chapter 07's GPU script).

    python3 scripts/gpu/measure/attention_publish.py BENCH.json ERRORS.jsonl PYTEST.log [OUT.json]

``ERRORS.jsonl`` holds one line per grid test (written by tests/test_attention_backends.py when
``MINISGL_ATTN_ERRORS`` is set): each backend's largest relative error against torch_native. The pytest summary
line ("25 passed in 63.30s") is copied as is. The result goes to OUT.json (default: BENCH.json, in place).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    bench_path, errors_path, log_path = map(Path, argv[:3])
    out_path = Path(argv[3]) if len(argv) > 3 else bench_path
    bench = json.loads(bench_path.read_text())
    errors = [json.loads(line) for line in errors_path.read_text().splitlines() if line.strip()]
    summary = [line.strip("= ") for line in log_path.read_text().splitlines() if re.search(r"\d+ (passed|failed)", line)]
    bench["correctness"] = {
        "command": "pytest -m gpu tests/test_attention_backends.py (scripts/gpu/measure/attention.sh tests)",
        "summary": summary[-1] if summary else "no pytest summary found",
        "tolerance": 1e-2,
        "max_rel_error": errors,
    }
    out_path.write_text(json.dumps(bench, indent=1) + "\n")
    print(f"wrote {out_path}: {bench['correctness']['summary']}, {len(errors)} grid tests")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
