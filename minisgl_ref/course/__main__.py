"""``python -m minisgl_ref.course``: make student copies, grade them, release solutions, check the tests' strength.

    student OUT --chapters 3-6        a student copy with chapters 03-06's tasks blanked (a fresh git repository)
    grade [--task 4.1 | --chapter 4] [--json results.json]
                                      run those tasks' tests, print points, write Gradescope's results.json
    solutions COPY --task 4.1         paste the reference's code for tasks into a student copy
    mutants [--task 4.1] [--jobs 2]   apply every known wrong answer and check that the grader catches it
    tasks                             the task table: points, time, difficulty, where the code is
    check                             every region can be blanked, the table matches the code and the tests
    gradescope --assignment 2 OUT.zip the autograder zip Gradescope takes for an assignment (--lock: re-pin it)
    pages [--check]                   write the course pages' generated parts (tables, scripts) from their sources

Run it from the root of a checkout (the reference or a student copy): it grades the package found there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minisgl_ref.course import autograder, gradescope, pages
from minisgl_ref.course import grade as grading
from minisgl_ref.course import mutants as mutation
from minisgl_ref.course import regions, student, table


def default_root() -> Path:
    """The checkout this package was imported from (a student copy grades its own code)."""
    import minisgl_ref

    return Path(minisgl_ref.__file__).resolve().parents[1]


def _load(root: Path) -> table.Table:
    return table.load(regions.scan(root))


def _selected(args: argparse.Namespace, t: table.Table) -> list[table.Task]:
    return t.select(args.task, args.chapters)


def cmd_student(args: argparse.Namespace) -> int:
    t = _load(args.root)
    if args.task is None and args.chapters is None:
        raise ValueError("student: say which tasks to blank with --chapters (e.g. 3-6) and/or --task")
    chosen = _selected(args, t)
    manifest = student.make_copy(args.root, Path(args.out), [task.id for task in chosen], commit=not args.no_git,
                                 unblank=args.unblank)
    print(f"student copy in {args.out}: {len(chosen)} tasks blanked ({', '.join(manifest['blank_tasks'])})")
    print(f"grade it from there with: {manifest['grade']}")
    return 0


def cmd_solutions(args: argparse.Namespace) -> int:
    t = _load(args.root)
    manifest = Path(args.copy) / student.MANIFEST
    if args.task is None and args.chapters is None and manifest.exists():  # default: what the copy has blank
        chosen = json.loads(manifest.read_text(encoding="utf-8"))["blank_tasks"]
    else:
        chosen = [task.id for task in _selected(args, t)]
    changed = student.fill_solutions(args.root, Path(args.copy), chosen)
    print(f"pasted the reference for tasks {', '.join(chosen)} into {len(changed)} file(s) of {args.copy}")
    return 0


def cmd_grade(args: argparse.Namespace) -> int:
    try:
        t = _load(args.root)
        chosen = _selected(args, t)
        result = grading.grade(args.root, chosen, timeout_s=args.timeout, quiet=not args.verbose)
    except (ValueError, RuntimeError, OSError) as e:
        if not args.json:
            raise
        # Gradescope still gets a report: 0 points and the reason (no other process runs after this one)
        _write(Path(args.json), grading.failure_report(str(e)))
        print(f"error: {e}\nwrote {args.json} (0 points)", file=sys.stderr)
        return 2
    print(grading.render(result))
    if args.json:
        _write(Path(args.json), result)
        print(f"wrote {args.json}")
    return 0


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


def cmd_mutants(args: argparse.Namespace) -> int:
    t = _load(args.root)
    wanted = {task.id for task in _selected(args, t)}
    known = mutation.load(args.root)
    kept: list[dict] = []  # --changed: the records that still hold, rewritten with the new ones
    if args.changed:
        if not args.json or not Path(args.json).exists():
            raise SystemExit("--changed needs --json naming an earlier run's results")
        kept = json.loads(Path(args.json).read_text())
        stale = mutation.stale_tasks(args.root, known, kept)
        wanted &= stale
        kept = [r for r in kept if r["task"] not in wanted and r["task"] in {m.task for m in known}]
        changed = ", ".join(sorted(wanted, key=regions.task_key)) or "none"
        print(f"tasks whose tests or mutants changed since that run: {changed}")
    chosen = [m for m in known if m.task in wanted]

    def show(o: mutation.Outcome) -> None:
        mark = "caught " if o.caught else "MISSED "
        print(f"{mark} {o.mutant.id:<32} {o.seconds:5.1f} s  {o.detail.splitlines()[0][:90]}", flush=True)

    outcomes = mutation.run(args.root, chosen, jobs=args.jobs, timeout_s=args.timeout, progress=show)
    per_task: dict[str, list[mutation.Outcome]] = {}
    for o in outcomes:
        per_task.setdefault(o.mutant.task, []).append(o)
    print("\ntask   caught / mutants   slowest")
    for task in sorted(per_task, key=regions.task_key):
        os_ = per_task[task]
        print(f"{task:<6} {sum(o.caught for o in os_):>6} / {len(os_):<9} {max(o.seconds for o in os_):6.1f} s")
    without = sorted(wanted - set(per_task), key=regions.task_key)
    if without:
        print(f"tasks without mutants: {', '.join(without)}")
    if args.json:
        records = kept + [
            {"task": o.mutant.task, "name": o.mutant.name, "digest": o.mutant.digest, "why": o.mutant.why,
             "tests_digest": mutation.tests_digest(args.root, o.mutant.task), "caught": o.caught,
             "seconds": round(o.seconds, 1), "detail": o.detail} for o in outcomes]
        order = {m.id: i for i, m in enumerate(known)}
        records.sort(key=lambda r: order.get(f"{r['task']}/{r['name']}", len(order)))
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0 if all(o.caught for o in outcomes) else 1


def cmd_tasks(args: argparse.Namespace) -> int:
    t = _load(args.root)
    print(f"{'task':<6}{'points':>7}{'min':>5}{'diff':>5}  {'title':<52} where")
    for task in t.tasks.values():
        where = ", ".join(r.where for r in task.regions)
        print(f"{task.id:<6}{task.points:>7g}{task.minutes:>5}{task.difficulty:>5}  {task.title[:52]:<52} {where}")
    print(f"{len(t.tasks)} tasks, {sum(x.points for x in t.tasks.values()):g} points")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    found = regions.problems(args.root)
    try:
        _load(args.root)
    except ValueError as e:
        found.append(str(e))
    for problem in found:
        print(problem)
    print("ok: every region can be blanked and the table matches the code" if not found else
          f"{len(found)} problem(s)")
    return 1 if found else 0


def cmd_gradescope(args: argparse.Namespace) -> int:
    if args.lock:
        path = autograder.TEMPLATES / autograder.REQUIREMENTS
        path.write_text(autograder.lock(args.root), encoding="utf-8")
        print(f"wrote {path} from this environment")
        if args.assignment is None:
            return 0
    if args.assignment is None or args.out is None:
        raise ValueError("gradescope: say which assignment and where: --assignment 2 autograder-a2.zip")
    built = gradescope.build(args.root, args.assignment, Path(args.out))
    blank = ", ".join(built["blank_tasks"])  # type: ignore[arg-type]
    print(f"{args.out}: assignment {built['assignment']} (chapters {built['chapters']}), {built['files']} files, "
          f"{int(built['bytes']) / 1e6:.1f} MB; blank: tasks {blank}")  # type: ignore[call-overload]
    print("upload it as the assignment's autograder (Configure Autograder > Zip file upload)")
    return 0


def cmd_pages(args: argparse.Namespace) -> int:
    if args.check:
        found = pages.problems(args.root)
        for problem in found:
            print(problem)
        print("ok: every generated part of the pages is filled and current" if not found else
              f"{len(found)} problem(s): run `python -m minisgl_ref.course pages`")
        return 1 if found else 0
    changed = pages.write(args.root)
    print(f"rewrote {', '.join(changed)}" if changed else "every page was current")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minisgl_ref.course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help="the checkout to work on (default: this one)")
    sub = parser.add_subparsers(dest="command", required=True)

    def selection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--task", default=None, help="task ids, comma-separated (e.g. 4.1,4.2)")
        p.add_argument("--chapter", "--chapters", dest="chapters", default=None,
                       help="chapters: a number, a range or a list (e.g. 4, 3-6, 0,2)")

    p = sub.add_parser("student", help="make a student copy")
    p.add_argument("out", help="an empty (or missing) folder, or an earlier copy to update")
    p.add_argument("--no-git", action="store_true", help="do not make the copy a git repository")
    p.add_argument("--unblank", action="store_true",
                   help="when updating a copy, allow tasks it had blank to come back with their solutions")
    selection(p)
    p.set_defaults(func=cmd_student)

    p = sub.add_parser("solutions", help="paste the reference's code for some tasks (default: every task the "
                                         "copy has blank) into a student copy")
    p.add_argument("copy", help="the student copy")
    selection(p)
    p.set_defaults(func=cmd_solutions)

    p = sub.add_parser("grade", help="grade tasks on this machine")
    selection(p)
    p.add_argument("--json", default=None, help="write the Gradescope-format report here")
    p.add_argument("--timeout", type=int, default=grading.DEFAULT_TIMEOUT_S, help="seconds allowed per test")
    p.add_argument("--verbose", action="store_true", help="show pytest's own output")
    p.set_defaults(func=cmd_grade)

    p = sub.add_parser("mutants", help="check that the tests catch every known wrong answer")
    selection(p)
    p.add_argument("--jobs", type=int, default=2, help="mutants graded at once")
    p.add_argument("--timeout", type=int, default=60, help="seconds allowed per test")
    p.add_argument("--json", default=None, help="write the outcomes here")
    p.add_argument("--changed", action="store_true",
                   help="only the tasks whose tests or mutants changed since the run recorded in --json, whose "
                        "records are then updated in place")
    p.set_defaults(func=cmd_mutants)

    p = sub.add_parser("gradescope", help="build an assignment's autograder zip for Gradescope")
    p.add_argument("out", nargs="?", default=None, help="the zip to write, e.g. autograder-a2.zip")
    p.add_argument("--assignment", type=int, default=None, help="the assignment's number (tasks.toml [assignments])")
    p.add_argument("--lock", action="store_true",
                   help="first pin requirements.txt to this environment's versions (run in the reference's .venv "
                        "after its tests pass)")
    p.set_defaults(func=cmd_gradescope)

    p = sub.add_parser("pages", help="write the generated parts of the course pages")
    p.add_argument("--check", action="store_true", help="only report unfilled or stale parts (exit status 1)")
    p.set_defaults(func=cmd_pages)

    sub.add_parser("tasks", help="print the task table").set_defaults(func=cmd_tasks)
    sub.add_parser("check", help="check regions, table and tests").set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.root = (args.root or default_root()).resolve()
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
