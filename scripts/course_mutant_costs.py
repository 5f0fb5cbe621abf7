"""What known wrong answers cost a student: each mutant applied alone and its task graded in full.

    python scripts/course_mutant_costs.py 5.1/remaining-from-prompt 4.3/evicts-locked-leaf
    python scripts/course_mutant_costs.py --task 5.1          # every mutant of a task

Prints, per mutant, the points its task still scores out of the task's points (checks split by their weights,
as the grader splits them). Each mutant runs all of its task's checks, so this takes a while per mutant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from minisgl_ref.course import mutants, regions, table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ids", nargs="*", help="mutants as task/name")
    parser.add_argument("--task", default=None, help="every mutant of these tasks (comma-separated)")
    args = parser.parse_args()
    tasks = table.load(regions.scan(ROOT)).tasks
    known = mutants.load(ROOT)
    wanted = set(args.ids)
    chosen = [m for m in known if m.id in wanted or (args.task and m.task in args.task.split(","))]
    unknown = wanted - {m.id for m in known}
    if unknown or not chosen:
        parser.error(f"no such mutants: {sorted(unknown)}" if unknown else "name mutants or --task")
    for m in chosen:
        score, out_of = mutants.cost(ROOT, m, tasks[m.task])
        print(f"{m.id:<48} {score:7.3f} / {out_of:g}  (costs {out_of - score:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
