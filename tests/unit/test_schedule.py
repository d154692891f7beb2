"""Schedules as data: text form, the communication pass, validation, dry runs, golden tables.

Regenerate the golden files (after hand-checking a diff) with
    VARUNAD_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_schedule.py
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import REPO, TESTS

from trainer.planning.lockstep import dry_run, format_table
from trainer.planning.schedule import (
    SCHEDULES,
    Action,
    Kind,
    ScheduleError,
    build_table,
    gpipe,
    one_f_one_b,
    schedule_named,
    stash_bound,
    validate,
    varuna,
    zero_bubble,
)

GOLDEN = TESTS / "golden"
GOLDEN_CASES = [(4, 6, True), (2, 4, True), (3, 5, True), (4, 6, False)]


def _strs(actions):
    return [str(a) for a in actions]


def _compute(table, stage):
    return [a for a in table[stage] if a.kind in (Kind.FORWARD, Kind.RECOMPUTE, Kind.BACKWARD, Kind.WEIGHT)]


# --- Action -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, action",
    [
        ("2F0", Action(2, Kind.FORWARD, 0)),
        ("1RG3", Action(1, Kind.RECV_GRAD, 3)),
        ("10RA12", Action(10, Kind.RECV_ACT, 12)),
        ("0R7", Action(0, Kind.RECOMPUTE, 7)),
        ("0AR", Action(0, Kind.ALLREDUCE)),
        ("3OPT", Action(3, Kind.STEP)),
    ],
)
def test_action_text_form(text, action):
    assert str(action) == text
    assert Action.parse(text) == action


@given(
    stage=st.integers(0, 99),
    kind=st.sampled_from(list(Kind)),
    mb=st.integers(0, 999),
)
def test_action_parse_inverts_str(stage, kind, mb):
    a = Action(stage, kind, None if kind in (Kind.ALLREDUCE, Kind.STEP) else mb)
    assert Action.parse(str(a)) == a


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "0AR1", "-1F0", "2F0x", "0OPT2"])
def test_action_parse_rejects(text):
    with pytest.raises(ScheduleError):
        Action.parse(text)


@pytest.mark.parametrize(
    "args",
    [(-1, Kind.FORWARD, 0), (0, Kind.FORWARD, None), (0, Kind.BACKWARD, -2), (0, Kind.STEP, 1), (0, "F", 0)],
)
def test_action_validates_itself(args):
    with pytest.raises(ValueError):
        Action(*args)


# --- generators and the communication pass ----------------------------------------------------


def test_single_stage_has_no_point_to_point_communication():
    for name in SCHEDULES:
        table = build_table(name, 1, 3)
        assert _strs(table[0]) == ["0F0", "0B0", "0F1", "0B1", "0F2", "0B2", "0AR", "0OPT"] or (
            name == "gpipe" and _strs(table[0]) == ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2", "0AR", "0OPT"]
        )


def test_gpipe_forwards_everything_first():
    assert _strs(gpipe(3, 3, 1, True)) == ["1F0", "1F1", "1F2", "1R0", "1B0", "1R1", "1B1", "1R2", "1B2"]
    assert _strs(gpipe(3, 2, 2, True)) == ["2F0", "2F1", "2B0", "2B1"]  # the last stage never recomputes


def test_one_f_one_b_warmup_steady_cooldown():
    assert _strs(one_f_one_b(4, 5, 1, False)) == [
        "1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1B3", "1B4",
    ]
    # fewer micro-batches than the warm-up depth: forward them all, then drain
    assert _strs(one_f_one_b(4, 2, 0, False)) == ["0F0", "0F1", "0B0", "0B1"]


def test_recv_grad_goes_after_recompute_only_for_varuna():
    v = _strs(build_table("varuna", 2, 1)[0])
    g = _strs(build_table("gpipe", 2, 1)[0])
    assert v == ["0F0", "0SA0", "0R0", "0RG0", "0B0", "0AR", "0OPT"]
    assert g == ["0F0", "0SA0", "0RG0", "0R0", "0B0", "0AR", "0OPT"]


def test_varuna_recomputes_just_in_time_and_fills_the_gap_with_a_forward():
    # Idealised run for P=4, m=6 (forward 3, recompute 3, backward 6; last stage 4 + 8):
    # stage 3 starts B0 at t=13, stage 2 recomputes 0 at t=15 and, as the gradient only arrives
    # at t=21, forwards micro-batch 3 in between; later R1 (t=27) is followed by F4 the same way.
    order = _strs(varuna(4, 6, 2, True))
    assert order[:6] == ["2F0", "2F1", "2F2", "2R0", "2F3", "2B0"]
    i = order.index("2R1")
    assert order[i : i + 3] == ["2R1", "2F4", "2B1"]


def test_zero_bubble_defers_a_stage_s_weight_passes_by_s():
    # the last of 4 stages runs F B pairs and holds its first three WEIGHT passes for the drain
    assert _strs(zero_bubble(4, 5, 3, False)) == [
        "3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3W0", "3F4", "3B4", "3W1", "3W2", "3W3", "3W4",
    ]
    # the first stage keeps its backward whole: 1F1B's order
    assert zero_bubble(4, 5, 0, False) == one_f_one_b(4, 5, 0, False)
    # a recomputing stage weighs right after each backward (one recomputed set at a time)
    assert _strs(zero_bubble(3, 2, 1, True)) == ["1F0", "1F1", "1R0", "1B0", "1W0", "1R1", "1B1", "1W1"]


def test_zero_bubble_drains_faster_than_1f1b_at_equal_peak_memory():
    # forward, input gradient and weight gradient of one unit each (1F1B's backward is two): the
    # paper's bubble of (P-1) units against 1F1B's 3(P-1), with the most any stage holds unchanged
    from trainer.planning.simulator import StageCost, Transfer, simulate

    for P, m in [(2, 4), (4, 8), (4, 16), (6, 12)]:
        free = Transfer(0.0, 0.0, 0.0, 0.0)
        cost = StageCost(forward_s=1.0, forward_graph_s=1.0, backward_s=2.0, recompute_s=1.0, send_act=free,
                         send_grad=free, allreduce_s=0.0, step_s=0.0, static_bytes=0, input_bytes=1,
                         activation_bytes=1)
        made = {name: simulate(build_table(name, P, m, False), [cost] * P) for name in ("1f1b", "zb-h1")}
        assert made["1f1b"].minibatch_s == 3 * m + 3 * (P - 1)
        assert made["zb-h1"].minibatch_s == 3 * m + (P - 1)
        peak = lambda r: max(st.peak_bytes for st in r.stages)  # noqa: E731
        assert peak(made["zb-h1"]) == peak(made["1f1b"])
    # calibrated passes replace the halves: with an input pass of 1.5 and a weight pass of 1 (half a
    # unit more than the whole backward) stage 1 is the slower and runs without a gap from its
    # first forward: 1 + 4 x 3.5
    split = dataclasses.replace(cost, split_s=(1.5, 1.0))
    assert simulate(build_table("zb-h1", 2, 4, False), [cost, split]).minibatch_s == 1 + 4 * 3.5
    # the gradients kept between the passes count from BACKWARD to WEIGHT: stage 1 of 2 defers one
    # weight pass, so it holds two micro-batches' (activations 1, input 1, kept 3 each) at its peak
    kept = dataclasses.replace(cost, split_bytes=3)
    assert simulate(build_table("zb-h1", 2, 4, False), [cost, kept]).stages[1].peak_bytes == 2 * (1 + 1 + 3)


def test_per_stage_recompute_flags():
    table = build_table("varuna", 3, 2, (False, True, True))
    kinds = {s: {a.kind for a in table[s]} for s in table}
    assert Kind.RECOMPUTE not in kinds[0] and Kind.RECOMPUTE in kinds[1]
    assert Kind.RECOMPUTE not in kinds[2]  # the last stage's flag is ignored: it keeps its graph
    validate(table, 3, 2, (False, True, False))
    with pytest.raises(ScheduleError, match="one flag per stage"):
        build_table("gpipe", 3, 2, (True, True))


def test_unknown_schedule_and_bad_sizes_are_refused():
    with pytest.raises(ScheduleError, match="schedule 'zigzag' is not one of varuna, gpipe, 1f1b, zb-h1"):
        build_table("zigzag", 2, 2)
    with pytest.raises(ScheduleError):
        build_table("varuna", 0, 2)
    with pytest.raises(ScheduleError):
        varuna(2, 2, 2)


def _releasing(compute):
    """The kind whose end frees a micro-batch's activations: its WEIGHT pass where the backward is split."""
    return Kind.WEIGHT if any(a.kind is Kind.WEIGHT for a in compute) else Kind.BACKWARD


def _max_stashed(compute):
    live = peak = 0
    release = _releasing(compute)
    for a in compute:
        live += (a.kind is Kind.FORWARD) - (a.kind is release)
        peak = max(peak, live)
    return peak


def _max_recomputed_waiting(compute):
    live = peak = 0
    for a in compute:
        live += {Kind.RECOMPUTE: 1, Kind.BACKWARD: -1 if live else 0}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


@settings(max_examples=150, deadline=None)
@given(
    P=st.integers(1, 6),
    m=st.integers(1, 12),
    name=st.sampled_from(sorted(SCHEDULES)),
    recompute=st.booleans(),
    per_stage=st.none() | st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_every_schedule_is_valid_and_runs_without_deadlock(P, m, name, recompute, per_stage):
    if per_stage is not None:  # the planner recomputes only on the stages short of memory
        recompute = tuple(per_stage[:P])
    table = build_table(name, P, m, recompute)
    validate(table, P, m, recompute)
    grid = dry_run(table)
    executed = [a for row in grid for a in row if a is not None]
    assert sorted(map(str, executed)) == sorted(str(a) for s in table for a in table[s])
    flags = [r and s < P - 1 for s, r in enumerate(recompute if per_stage else [recompute] * P)]
    if name == "1f1b":
        for s in range(P):
            assert _max_stashed(_compute(table, s)) <= min(P - s, m)
    if name == "varuna":  # inputs only are stashed where recomputing, so twice the slack
        for s in range(P):
            assert _max_stashed(_compute(table, s)) <= min((2 if flags[s] else 1) * (P - s), m)
    if name == "varuna":
        for s in range(P):
            assert _max_recomputed_waiting(_compute(table, s)) <= 1


def _peak_stash(compute):
    """Most micro-batches forwarded and not yet backwarded (weighed, where split) at any point of
    one stage's order."""
    return _max_stashed(compute)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_memory_rule_is_the_peak_stash_of_the_generated_orders(name):
    # the planner sizes stages by `stash_bound`; if a generator changed its order (or the rule
    # changed) without the other, plans would under- or over-reserve memory. With one flag for
    # every stage the rule is the peak exactly; with mixed flags a recomputing stage behind one
    # that does not can be held below its bound by its predecessor, so the rule is an upper bound.
    for P in range(1, 7):
        mixed = [tuple(s % 2 == 0 for s in range(P)), tuple(s % 2 == 1 for s in range(P))]
        for m in sorted({1, 2, max(P - 1, 1), P, P + 1, 2 * P, 2 * P + 3, 4 * P}):
            for flags in [(True,) * P, (False,) * P] + mixed:
                table = build_table(name, P, m, flags)
                for s in range(P):
                    got = _peak_stash(_compute(table, s))
                    want = stash_bound(name, P, s, m, flags[s])
                    where = f"{name} P={P} m={m} recompute={flags}: stage {s} stashes {got}, the rule says {want}"
                    if len(set(flags[:-1])) <= 1:
                        assert got == want, where
                    else:
                        assert got <= want, where


def test_the_memory_rule_refuses_bad_input():
    with pytest.raises(ScheduleError, match="schedule 'zigzag' is not one of"):
        stash_bound("zigzag", 4, 0, 8, True)
    with pytest.raises(ScheduleError, match="stage 4 is outside 0..3"):
        stash_bound("varuna", 4, 4, 8, True)
    assert stash_bound("varuna", 4, 3, 8, True) == 1  # the last stage never recomputes


def test_slack_is_read_off_the_memory_rule():
    # the planner's closed form charges a message hop to every stage that cannot run ahead of the
    # P-s micro-batches that fill the pipeline; these are the stages it charged by name before
    for P in range(2, 7):
        for s in range(P - 1):
            for rec in (False, True):
                assert not SCHEDULES["1f1b"].has_slack(P, s, rec)
                assert SCHEDULES["gpipe"].has_slack(P, s, rec)
                assert SCHEDULES["varuna"].has_slack(P, s, rec) is rec
                # deferred WEIGHT passes are not forwards run ahead: no slack for a late message
                assert not SCHEDULES["zb-h1"].has_slack(P, s, rec)


@pytest.mark.parametrize("name", ["zigzag", "", "Varuna", None, ["varuna"], 1])
def test_schedule_names_are_checked_in_one_place(name):
    with pytest.raises(ScheduleError, match=r"is not one of varuna, gpipe, 1f1b, zb-h1$"):
        schedule_named(name)


def test_no_module_decides_by_a_schedule_name():
    # a schedule's facts live in its record; a comparison with its name elsewhere is a fact kept
    # apart from it, which a new schedule would silently miss
    root = REPO
    names = "|".join(re.escape(n) for n in SCHEDULES)
    compared = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = [f"{path.relative_to(root)}:{i}: {line.strip()}"
             for top in ("trainer", "varunad", "protocol") for path in sorted((root / top).rglob("*.py"))
             if path.name != "schedule.py"
             for i, line in enumerate(path.read_text().splitlines(), 1) if compared.search(line)]
    assert found == []


def test_varuna_is_deterministic():
    from trainer.planning.schedule import _varuna_orders

    first = build_table("varuna", 5, 9)
    _varuna_orders.cache_clear()
    assert build_table("varuna", 5, 9) == first


# --- validate -----------------------------------------------------------------------------------


def _table_with(stage_list_edit):
    table = build_table("1f1b", 3, 3)
    table = {s: list(v) for s, v in table.items()}
    stage_list_edit(table)
    return table


def _swap(table, stage, a, b):
    lst = table[stage]
    i, j = lst.index(Action.parse(a)), lst.index(Action.parse(b))
    lst[i], lst[j] = lst[j], lst[i]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t[1].remove(Action.parse("1R2")), "lacks 1R2"),
        (lambda t: t[2].insert(0, Action.parse("2R0")), "must not have RECOMPUTE"),
        (lambda t: t[0].insert(0, Action.parse("0F1")), "appears twice"),
        (lambda t: t[0].insert(0, Action.parse("0F7")), "micro-batch 7"),
        (lambda t: t[1].insert(0, Action.parse("2F0")), "listed under stage 1"),
        (lambda t: t.pop(2), "expected 0..2"),
        (lambda t: _swap(t, 2, "2F0", "2B0"), "before its forward"),
        (lambda t: _swap(t, 1, "1R0", "1F0"), "must come between"),
        (lambda t: _swap(t, 1, "1RA1", "1RA2"), "immediately before"),
        (lambda t: _swap(t, 0, "0SA1", "0SA2"), "immediately after"),
        (lambda t: _swap(t, 1, "1SG0", "1SG1"), "immediately after"),
        (lambda t: t[0].pop(), "end with exactly 0AR then 0OPT"),
        (lambda t: _swap(t, 2, "2AR", "2OPT"), "end with exactly"),
        (lambda t: t[1].insert(t[1].index(Action.parse("1B0")), Action.parse("1W0")), "lacks 1W1"),
        (lambda t: t[0].insert(0, Action.parse("0W0")), "stage 0 of 3 must not split"),
    ],
)
def test_validate_names_the_broken_rule(edit, message):
    table = _table_with(edit)
    with pytest.raises(ScheduleError, match=message):
        validate(table, 3, 3, True)


def test_validate_wants_each_weight_pass_after_its_backward():
    table = {s: list(v) for s, v in build_table("zb-h1", 3, 3, False).items()}
    validate(table, 3, 3, False)
    table[2].remove(Action.parse("2W0"))
    table[2].insert(0, Action.parse("2W0"))
    with pytest.raises(ScheduleError, match="2W0 must come after 2B0"):
        validate(table, 3, 3, False)


def test_validate_refuses_recompute_when_it_is_off():
    with pytest.raises(ScheduleError, match="must not have RECOMPUTE"):
        validate(build_table("varuna", 3, 3, True), 3, 3, False)


# --- dry run ------------------------------------------------------------------------------------


def test_dry_run_reports_a_deadlock_with_the_grid():
    table = {s: list(v) for s, v in build_table("1f1b", 2, 2).items()}
    _swap(table, 0, "0SA0", "0RG0")  # stage 0 now waits for a gradient before sending anything
    with pytest.raises(ScheduleError) as err:
        dry_run(table)
    text = str(err.value)
    assert "deadlock after 1 steps" in text
    assert "0RG0 waits for 1SG0" in text and "1RA0 waits for 0SA0" in text
    assert ">>0RG0<<" in text and ">>1RA0<<" in text
    assert "step" in text and "stage 1" in text  # the grid itself


def test_dry_run_grid_shape_for_a_tiny_pipeline():
    grid = dry_run(build_table("gpipe", 2, 1, False))
    shown = [["." if a is None else str(a) for a in row] for row in grid]
    # a receive runs one step after its send at the earliest; a waiting stage shows "."
    assert shown == [
        ["0F0", "."],
        ["0SA0", "."],
        [".", "1RA0"],
        [".", "1F0"],
        [".", "1B0"],
        [".", "1SG0"],
        ["0RG0", "1AR"],
        ["0B0", "1OPT"],
        ["0AR", "."],
        ["0OPT", "."],
    ]


# --- golden tables ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("P, m, recompute", GOLDEN_CASES)
def test_golden_tables(name, P, m, recompute):
    text = format_table(build_table(name, P, m, recompute)) + "\n"
    path = GOLDEN / f"{name}_P{P}_m{m}{'' if recompute else '_norecompute'}.txt"
    if os.environ.get("VARUNAD_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.read_text() == text


def test_format_table_lines_parse_back():
    table = build_table("varuna", 3, 4)
    parsed = {}
    for line in format_table(table).splitlines():
        head, body = line.split(": ")
        parsed[int(head.split()[1])] = [Action.parse(x) for x in body.split()]
    assert parsed == table
