"""Live progress of a job from successive ``varunactl status JOB --json`` documents.

``advance(shown, doc)`` is pure: from what was already shown and the newest status document it
returns the new ``Shown`` and the exact text to write. On a terminal that text redraws one bar
line in place (carriage return + ANSI erase-line)::

    gpt [######..............] 30/100 loss 2.412 84 samples/s 2x2 mb 4 epoch 117

Elsewhere (a log file, CI) it is plain lines, one per change of state or plan, and one per
``every_steps`` steps or ``every_s`` seconds of progress, so a log stays readable. Either way
each morph is printed once, on its own line::

    morph 2x2 -> 3x1 (stopped, re-planned in 4.8s): member vm3 left
    resumed at step 20 in epoch 305 after training stood still 21.0s (the report counts the same)

and while an epoch redoes steps an earlier one had trained, or the checkpoint store refuses
writes, the line says so::

    gpt [####................] 23/60 ... 2x1 mb 4 epoch 305 redoing steps 20-29 after vm4 was lost
    gpt [########............] 31/60 ... checkpoints failing since step 24: No space left on device (...)

``watch`` polls etcd and feeds ``advance`` until the job ends.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TextIO

from varunad.control.records import stall_before
from varunad.control.resume import ResumeSource
from varunad.control.status import elapsed

__all__ = ["Shown", "start", "advance", "finish", "bar_line", "plain_line", "morph_line", "morph_source", "watch"]

_CLEAR = "\r\x1b[K"
_TERMINAL = ("done", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class Shown:
    """What has been written so far for one job (the renderer's whole state)."""

    job: str
    steps: int
    tty: bool
    every_steps: int
    every_s: float
    morphs: int = 0
    bar: str = ""
    line_key: tuple = ()  # state and plan of the last plain line
    line_step: int = -1
    line_at: float = float("-inf")
    resume_epoch: int = 0  # the newest morph's epoch, until its first step is seen
    resume_noticed: float = 0.0  # when the leader noticed that morph (wall clock)


def start(job: str, steps: int, *, tty: bool, every_steps: int | None = None, every_s: float = 30.0) -> Shown:
    """Nothing shown yet; plain output prints about ten step lines per job unless told otherwise."""
    return Shown(job=job, steps=max(steps, 1), tty=tty, every_steps=every_steps or max(1, steps // 10),
                 every_s=every_s)


def _shape(doc: dict[str, Any]) -> str:
    plan = doc.get("plan") or {}
    if not plan.get("P"):
        return ""
    return f"{plan['P']}x{plan['D']} mb {plan['micro_batch_size']} epoch {doc.get('epoch')}"


def _numbers(doc: dict[str, Any]) -> str:
    parts = []
    if doc.get("loss") is not None:
        parts.append(f"loss {doc['loss']:.3f}")
    rate = doc.get("samples_per_s")
    if rate and doc.get("state") == "running":
        parts.append(f"{rate:.0f} samples/s" if rate >= 10 else f"{rate:.1f} samples/s")
    return " ".join(parts)


def _redoing(doc: dict[str, Any]) -> str:
    redo = doc.get("redoing")
    if not redo or doc.get("state") != "running":
        return ""
    return f"redoing steps {redo['first']}-{redo['last']}" + (f" after {redo['cause']}" if redo.get("cause") else "")


def _store_failing(doc: dict[str, Any]) -> str:
    return _one_line(doc.get("store_failing") or "", 100)


def _stragglers(doc: dict[str, Any]) -> str:
    slow = doc.get("stragglers") or {}
    return ("straggler " + ", ".join(f"{slot} {factor:.1f}x slower" for slot, factor in sorted(slow.items()))
            if slow else "")


def _state_word(doc: dict[str, Any], limit: int | None = 60) -> str:
    """Nothing while running; otherwise the state in status's words (restarting, stopping or
    morphing for a job between plans) and why (e.g. queued while the model is calibrated), cut
    to `limit` characters on a terminal's bar."""
    state = doc.get("state", "?")
    if state == "running":
        return ""
    word = doc.get("activity") or state
    reason = _one_line(doc.get("reason") or "", limit)
    if limit is not None and doc.get("calibrating_s") is not None:   # the redrawn bar only: a log's line would change every second
        reason += f", {elapsed(doc['calibrating_s'])}"
    return f"{word} ({reason})" if reason and state in ("queued", "morphing") else str(word)


def _one_line(text: str, limit: int | None) -> str:
    # a reason may quote a worker's last output: its first line says enough
    first = (text.strip().splitlines() or [""])[0]
    return first if limit is None or len(first) <= limit else first[:limit - 1] + "…"


def bar_line(doc: dict[str, Any], steps: int, width: int = 20) -> str:
    """``job [####....] step/steps loss .. samples/s PxD mb M epoch E [state]``."""
    step = min(int(doc.get("step") or 0), steps)
    filled = width * step // max(steps, 1)
    parts = [f"{doc['job']} [{'#' * filled}{'.' * (width - filled)}] {step}/{steps}",
             _numbers(doc), _shape(doc), _state_word(doc), _redoing(doc), _store_failing(doc), _stragglers(doc)]
    return " ".join(p for p in parts if p)


def plain_line(doc: dict[str, Any], steps: int) -> str:
    """``job step/steps state: loss .. samples/s PxD mb M epoch E``."""
    step = min(int(doc.get("step") or 0), steps)
    details = " ".join(p for p in (_numbers(doc), _shape(doc), _redoing(doc), _store_failing(doc), _stragglers(doc))
                       if p)
    # a log has room for the whole reason (a probe's CI log read "re-planning on the …")
    return f"{doc['job']} {step}/{steps} {_state_word(doc, None) or 'running'}" + (f": {details}" if details else "")


def morph_line(morph: dict[str, Any]) -> str:
    # The leader's figure covers noticing, stopping and re-planning; the new epoch's start-up and
    # any steps redone from the checkpoint come after it (`varunactl report` counts those).
    what = (f"restart {morph['to']} after {morph.get('cause') or 'a worker failed'}" if morph.get("restart")
            else f"morph {morph['from']} -> {morph['to']}")
    source = morph_source(morph)
    return (f"{what} (stopped, re-planned in {morph['duration_s']:.1f}s{', ' + source if source else ''}): "
            f"{_one_line(morph['reason'], None)}")   # printed once, above the bar: whole


def morph_source(morph: dict[str, Any]) -> str:
    """'resuming from replicas at step 137' / 'resuming from checkpoint 120 (stage 1 had no live
    replica (vm3))': where the state of the new epoch comes from (varunad.control.resume)."""
    step = morph.get("resumed_from")
    words = ResumeSource(str(morph.get("source") or ""), step if isinstance(step, int) and step >= 0 else None,
                         str(morph.get("source_why") or "")).words
    return f"resuming {words}" if words else ""


def _resumed(shown: Shown, doc: dict[str, Any], wall: float) -> tuple[Shown, list[str]]:
    """The line that closes a morph: the first step of its epoch is in the loss history, so the
    pause (noticing, stopping, re-planning, starting the workers, loading the checkpoint) is over."""
    steps = (doc.get("epochs") or {}).get(str(shown.resume_epoch)) if shown.resume_epoch else None
    if not steps:
        return shown, []
    stall = _stall(doc, shown.resume_epoch, wall - shown.resume_noticed)
    line = f"resumed at step {steps[0]} in epoch {shown.resume_epoch}{stall}\n"
    return replace(shown, resume_epoch=0), [line]


def _stall(doc: dict[str, Any], epoch: int, since_noticed: float) -> str:
    """How long training stood still: from the last step of the epoch before to this epoch's first,
    the figure `varunactl report` adds up (a lost VM's lease runs out before the leader notices, so
    it is longer than the time since the morph began, which is shown only when spans are missing)."""
    spans = {int(e): v for e, v in (doc.get("epoch_spans") or {}).items()}
    gap = stall_before(epoch, (int(e) for e in doc.get("epochs") or {}), spans)
    if gap is None:
        return f", {max(0.0, since_noticed):.1f}s after the morph began"
    return f" after training stood still {max(0.0, gap):.1f}s (the report counts the same)"


def advance(shown: Shown, doc: dict[str, Any], now: float, wall: float | None = None) -> tuple[Shown, str]:
    """The next ``Shown`` and the text to write for status ``doc`` seen at ``now`` (monotonic seconds)
    and ``wall`` (wall-clock seconds, default the time now: morph times are the leader's wall clock)."""
    morphs = doc.get("morphs") or []
    new_morphs = [morph_line(m) + "\n" for m in morphs[shown.morphs:]]
    if new_morphs:
        last = morphs[-1]
        shown = replace(shown, resume_epoch=int(last.get("to_epoch") or 0),
                        resume_noticed=float(last.get("noticed_at") or 0.0))
    shown = replace(shown, morphs=max(shown.morphs, len(morphs)))
    shown, resumed = _resumed(shown, doc, time.time() if wall is None else wall)
    new_morphs += resumed
    if shown.tty:
        bar = bar_line(doc, shown.steps)
        if not new_morphs and bar == shown.bar:
            return shown, ""
        # a morph line takes the bar's place, and the bar is drawn again below it
        return replace(shown, bar=bar), _CLEAR + "".join(new_morphs) + bar
    step = int(doc.get("step") or 0)
    key = (_state_word(doc, None), _shape(doc), bool(doc.get("store_failing")))
    due = step != shown.line_step and (step - shown.line_step >= shown.every_steps
                                       or now - shown.line_at >= shown.every_s)
    if key != shown.line_key or due:  # the end is a new state, so it always gets its line
        line = plain_line(doc, shown.steps) + "\n"
        return replace(shown, line_key=key, line_step=step, line_at=now), "".join(new_morphs) + line
    return shown, "".join(new_morphs)


def finish(shown: Shown) -> str:
    """What ends the output: the newline after a terminal's bar line."""
    return "\n" if shown.tty and shown.bar else ""


async def watch(store, keys, job: str, out: TextIO = sys.stdout, *, interval: float = 1.0,
                tty: bool | None = None,
                on_status: Callable[[dict[str, Any]], Awaitable[str | None]] | None = None) -> int:
    """Show ``job``'s progress on ``out`` until it ends: 0 when done, 1 when failed or cancelled.

    ``on_status(doc)``, awaited after each poll, may act on the job (the demo kills a daemon
    halfway) and return a line to print; on a terminal it goes above the bar."""
    from varunad.control.fleet import usable_spec
    from varunad.control.jobs import JobSpecError
    from varunad.ctl import commands as ctl
    from varunad.store.contract import StoreUnavailable

    kv = await store.get(keys.job(job))
    if kv is None:
        raise ctl.CtlError(f"no job named {job} (see `varunactl jobs`)")
    try:   # the spec the fleet runs: as submitted, whatever was written over its key since
        spec = (await usable_spec(store, kv, job, timeout=None))[0]
    except JobSpecError as exc:
        raise ctl.CtlError(f"job {job}: its spec in etcd is unreadable ({exc}), and so is the one it was "
                           "submitted with") from None
    shown = start(job, spec.steps, tty=out.isatty() if tty is None else tty)
    doc: dict[str, Any] = {}
    unanswered = 0.0   # since when etcd has not answered (0: it answers)
    try:
        while doc.get("state") not in _TERMINAL:
            if doc or unanswered:
                await asyncio.sleep(interval)
            try:
                doc = await ctl.job_status(store, keys, job)
            except StoreUnavailable as exc:
                # the fleet rides through an etcd pause or restart; so does whoever watches it
                # (watch exited 1 after 5 s, the code of a failed job, while the job trained on)
                if not unanswered:
                    unanswered = time.monotonic()
                    print(f"{_CLEAR if shown.tty else ''}etcd does not answer ({str(exc).splitlines()[0][:200]}); "
                          "still watching (Ctrl-C to stop)", file=sys.stderr, flush=True)
                continue
            if unanswered:
                print(f"etcd answers again after {time.monotonic() - unanswered:.0f}s", file=sys.stderr, flush=True)
                unanswered = 0.0
            shown, text = advance(shown, doc, time.monotonic())
            note = await on_status(doc) if on_status else None
            if note:
                text += f"{_CLEAR}{note}\n{shown.bar}" if shown.tty else note + "\n"
            if text:
                out.write(text)
                out.flush()
    finally:  # also on Ctrl-C: the shell's prompt must not land on the bar line
        out.write(finish(shown))
        out.flush()
    if doc["state"] == "done":
        return 0
    print(f"{job} {doc['state']}: {doc['reason']}", file=out)
    return 1
