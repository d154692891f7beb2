"""Walk a schedule table in lock-step without devices, and print it.

`dry_run` finds a table's deadlock before any worker would hang on it, and shows where; the text
forms are what a deadlock report and the golden files (tests/golden) show.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from trainer.planning.schedule import Action, Kind, ScheduleError

__all__ = ["dry_run", "format_grid", "format_table"]


def _matching_send(a: Action) -> Action | None:
    if a.kind is Kind.RECV_ACT:
        return Action(a.stage - 1, Kind.SEND_ACT, a.micro_batch)
    if a.kind is Kind.RECV_GRAD:
        return Action(a.stage + 1, Kind.SEND_GRAD, a.micro_batch)
    return None


def dry_run(table: Mapping[int, Sequence[Action]]) -> list[list[Action | None]]:
    """Walk the table in lock-step without devices: receives block until the matching send ran
    in an earlier step, everything else proceeds. Returns the step x stage grid (None where a
    stage waits or is done); raises ScheduleError with the grid, stuck cells marked, on deadlock."""
    stages = sorted(table)
    lists = [list(table[s]) for s in stages]
    sent: set[Action] = set()
    cursor = [0] * len(stages)
    grid: list[list[Action | None]] = []
    while any(c < len(lst) for c, lst in zip(cursor, lists)):
        row: list[Action | None] = []
        for i, lst in enumerate(lists):
            if cursor[i] >= len(lst):
                row.append(None)
                continue
            a = lst[cursor[i]]
            need = _matching_send(a)
            if need is not None and need not in sent:
                row.append(None)
            else:
                row.append(a)
        if all(c is None for c in row):
            stuck = {
                i: lists[i][cursor[i]] for i in range(len(lists)) if cursor[i] < len(lists[i])
            }
            waits = ", ".join(f"{a} waits for {_matching_send(a)}" for a in stuck.values())
            raise ScheduleError(
                f"deadlock after {len(grid)} steps: {waits}\n" + format_grid(grid, stages, stuck)
            )
        for i, a in enumerate(row):
            if a is not None:
                cursor[i] += 1
                if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                    sent.add(a)
        grid.append(row)
    return grid


def format_grid(
    grid: Sequence[Sequence[Action | None]],
    stages: Sequence[int] | None = None,
    stuck: Mapping[int, Action] | None = None,
) -> str:
    """Steps as rows, stages as columns; '.' is a wait, a stuck cell is shown as '>>1RG3<<'."""
    n = len(grid[0]) if grid else len(stages or [])
    names = list(stages) if stages is not None else list(range(n))
    rows = [["step"] + [f"stage {s}" for s in names]]
    for t, r in enumerate(grid):
        rows.append([str(t)] + ["." if a is None else str(a) for a in r])
    if stuck is not None:
        rows.append(["stuck"] + [f">>{stuck[i]}<<" if i in stuck else "" for i in range(n)])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows
    )


def format_table(table: Mapping[int, Sequence[Action]]) -> str:
    """One line per stage, actions in execution order (the form kept in golden files)."""
    return "\n".join(
        f"stage {s}: " + " ".join(str(a) for a in table[s]) for s in sorted(table)
    )
