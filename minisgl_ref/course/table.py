"""The task table (``tasks.toml``) joined with the regions in the code: what each task is worth and needs."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from minisgl_ref.course.regions import Region, chapter_of, task_key, tasks_of

TABLE = Path(__file__).with_name("tasks.toml")


@dataclass(frozen=True)
class Task:
    id: str
    title: str
    points: float
    minutes: int = 0
    difficulty: int = 1
    hint: str = ""
    depends: tuple[str, ...] = ()
    visibility: str = "visible"
    regions: tuple[Region, ...] = field(default=(), compare=False)

    @property
    def chapter(self) -> int:
        return chapter_of(self.id)


@dataclass(frozen=True)
class Table:
    chapters: dict[int, str]
    tasks: dict[str, Task]  # in task order

    def select(self, tasks: str | None = None, chapters: str | None = None) -> list[Task]:
        """The tasks named by ``--task 4.1,4.2`` and/or ``--chapter 3-6``, in order (every task if neither)."""
        chosen = set(self.tasks) if tasks is None and chapters is None else set()
        for t in (tasks or "").split(","):
            if t.strip():
                if t.strip() not in self.tasks:
                    raise ValueError(f"--task: no task {t.strip()!r} (tasks: {', '.join(self.tasks)})")
                chosen.add(t.strip())
        if chapters:
            wanted = parse_chapters(chapters)
            chosen |= {t for t in self.tasks if chapter_of(t) in wanted}
        return [self.tasks[t] for t in sorted(chosen, key=task_key)]


def parse_chapters(spec: str) -> set[int]:
    """``"3-6"``, ``"4"``, ``"0,2,4-5"`` -> a set of chapter numbers."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                out |= set(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError(f"--chapters: {part!r} is not a chapter number or a range like 3-6") from None
    return out


def load(regions: list[Region], path: Path = TABLE) -> Table:
    """The table at ``path`` for the tasks found in the code; raises ``ValueError`` naming what disagrees."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    rows = data.get("tasks", {})
    titles = tasks_of(regions)
    missing = [t for t in titles if t not in rows]
    extra = [t for t in rows if t not in titles]
    if missing or extra:
        raise ValueError(f"{path.name}: tasks in the code but not in the table: {missing}; in the table but not "
                         f"in the code: {extra}")
    tasks = {}
    for task_id, title in titles.items():
        row = rows[task_id]
        unknown = set(row) - {"points", "minutes", "difficulty", "hint", "depends", "visibility"}
        if unknown:
            raise ValueError(f"{path.name}: task {task_id}: unknown fields {sorted(unknown)}")
        depends = tuple(row.get("depends", ()))
        for d in depends:
            if d not in titles:
                raise ValueError(f"{path.name}: task {task_id} depends on {d!r}, which is not a task")
        tasks[task_id] = Task(
            id=task_id, title=title, points=float(row["points"]), minutes=int(row.get("minutes", 0)),
            difficulty=int(row.get("difficulty", 1)), hint=row.get("hint", ""), depends=depends,
            visibility=row.get("visibility", "visible"),
            regions=tuple(r for r in regions if r.task == task_id),
        )
    chapters = {int(k): v for k, v in data.get("chapters", {}).items()}
    return Table(chapters, tasks)
