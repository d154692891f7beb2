"""How a worker sets itself up, apart from the Varuna object that does it: its assignment (from the
environment, or a lone worker's), the tree its step statistics are summed over, the sizes it
accepts, its device, where its stage's tensors live (aliases, placement, freeing the rest), its
tensor streams' security, and the size of a shard it is given. Plain functions of their
arguments, so each is tested and read without a worker."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from protocol.errors import SecurityError
from protocol.security import Security, SecurityConfig
from trainer.errors import ConfigError
from trainer.planning.parallel import (
    ParallelPlan,
    ParallelPlanError,
    check_shares,
    micro_batches,
    per_replica_fields,
    per_stage_fields,
    share_micro_batches,
)
from trainer.planning.schedule import ScheduleError, schedule_named
from trainer.worker_env import WorkerAssignment

__all__ = [
    "assignment_for",
    "stats_tree",
    "check_sizes",
    "choose_device",
    "device_of",
    "aliases",
    "named_tensors",
    "all_tensors",
    "move_in_place",
    "free_other_stages",
    "stream_security",
    "shard_size",
    "captured_shapes",
    "check_shapes",
    "uncompiled",
]

log = logging.getLogger("varuna")

def assignment_for(stage_to_rank_map) -> WorkerAssignment:
    if "VARUNA_RANK" not in os.environ:
        if stage_to_rank_map is None or sum(len(r) for r in stage_to_rank_map.values()) == 1:
            log.warning("no worker assignment in the environment: running as a single worker (1 x 1); "
                        "start with `python -m trainer.launch` for more")
            return WorkerAssignment(rank=0, plan=ParallelPlan(P=1, D=1), endpoints=["inproc://varuna-0"], dist_url="")
    a = WorkerAssignment.from_env()
    if stage_to_rank_map is not None:
        try:
            given = ParallelPlan.from_stage_to_rank(stage_to_rank_map)
        except ParallelPlanError as exc:
            raise ConfigError(str(exc), hint='pass stage_to_rank_map like {0: [0, 2], 1: [1, 3]}, or None') from None
        if given.world_size != a.plan.world_size:
            raise ConfigError(f"stage_to_rank_map has {given.world_size} ranks, the job was started with "
                              f"{a.plan.world_size} workers", hint="pass None to use the launcher's or daemon's plan")
        # The map renumbers, and may reshape: every field of the plan the shape does not size is
        # kept (a field added to the plan included), its subclass too; the per-stage and
        # per-replica ones are reset (a reshape keeps the world size, so it changes P and D both).
        reshaped = {} if given.shape == a.plan.shape else \
            {"P": given.P, "D": given.D, **dict.fromkeys((*per_stage_fields(a.plan), *per_replica_fields(a.plan)))}
        try:
            plan = a.plan.replace(ranks=given.ranks, **reshaped)
        except ParallelPlanError as exc:
            raise ConfigError(f"stage_to_rank_map does not fit the job's plan: {exc}",
                              hint="pass None to use the launcher's or daemon's plan") from None
        a = dataclasses.replace(a, plan=plan)
    return a


def stats_tree(plan: ParallelPlan, stage: int, replica: int) -> tuple[int | None, list[int]]:
    """(parent, children) of this worker in the tree the step statistics are summed over: each
    replica's stage 0 gathers its pipeline, and replica 0's stage 0 (the root) the other
    replicas' stage 0s. Sums go up, the root's total comes back down the same edges."""
    P, D, stage_to_rank = plan.P, plan.D, plan.ranks
    head = stage_to_rank[0][replica]
    if stage > 0:
        return head, []
    pipeline = [stage_to_rank[s][replica] for s in range(1, P)]
    if replica > 0:
        return stage_to_rank[0][0], pipeline
    return None, pipeline + [stage_to_rank[0][r] for r in range(1, D)]


def check_sizes(batch: int, chunk: int, D: int, precision: str, schedule: str,
                shares: Sequence[int] | None = None) -> None:
    """`shares`: the plan's uneven split of the batch (None: even), which need not divide it."""
    if shares is None:
        micro_batches(batch, D, chunk)  # the one rule, as `varunactl submit` and the planner follow it
    else:
        check_shares(batch, shares)     # the plan checked their count and that each is >= 1
        share_micro_batches(min(shares), chunk)
    if precision not in ("fp32", "fp16", "bf16"):
        raise ConfigError(f"precision must be fp32, fp16 or bf16, got {precision!r}")
    try:
        schedule_named(schedule)
    except ScheduleError as exc:
        raise ConfigError(str(exc)) from None


def choose_device(a: WorkerAssignment, local_rank: int, device: int | str | torch.device) -> torch.device:
    # a GPU by name, not a local rank (`device=local_rank`, as Varuna's scripts pass, runs anywhere)
    asked_gpu = (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")
    if asked_gpu and a.device is not None and str(a.device) in ("cpu", "-1", ""):
        # the slot decides: a script that asks for a GPU on a fleet whose GPUs are gone (a failed
        # driver) trained on the CPU with no word (a probe)
        log.warning("the script asks for device %r, but this worker's slot is the CPU (the daemon's or the "
                    "launcher's choice, which wins): training on the CPU. Where the VM has GPUs, check that "
                    "nvidia-smi sees them", device)
    choice = a.device if a.device is not None else device
    if isinstance(choice, torch.device):
        return choice
    if isinstance(choice, str) and choice not in ("-1", ""):
        return torch.device(choice if not choice.isdigit() else f"cuda:{choice}")
    if isinstance(choice, int) and choice >= 0:
        return torch.device(f"cuda:{choice}")
    if local_rank >= 0 and torch.cuda.is_available():
        return torch.device(f"cuda:{local_rank}")
    return torch.device("cpu")


def device_of(model: nn.Module) -> torch.device:
    """Where the model's tensors are, so that the capture's sample batch is there too."""
    t = next(iter(model.parameters()), None)
    return t.device if t is not None else torch.device("cpu")


def aliases(model: nn.Module, canonical: Mapping[int, str]) -> dict[str, str]:
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = canonical.get(id(p), name)
    return out


def named_tensors(model, canonical, mine, also: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """The tensors of the stage `mine` (and the names in `also`) by their canonical names."""
    by_name = {canonical[id(t)]: t for t in (*model.parameters(), *model.buffers()) if id(t) in canonical}
    return {n: by_name[n] for n in (*mine.owned, *mine.owned_buffers, *sorted(also))}


def all_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model once, by its first name (a lone worker's stage)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def move_in_place(tensors, device: torch.device) -> None:
    """Move tensors to `device` keeping each the same Python object. Module.to replaces buffers
    with new tensors, which would leave `_named` (what checkpoints save and load) holding the
    stale host copies while the stage computes with the device ones."""
    with torch.no_grad():
        for t in tensors:
            if t.device != device:
                t.data = t.data.to(device)


def free_other_stages(model: nn.Module, canonical, keep: set[str]) -> None:
    """Release the storage of tensors other stages own (per-stage memory ~ 1/P); the user's
    model object keeps empty placeholders for them, and calling it says so. Meta tensors have no
    storage to release."""
    freed = False
    for t in (*model.parameters(), *model.buffers()):
        if canonical.get(id(t)) not in keep and not t.is_meta:
            t.data = torch.empty(0, dtype=t.dtype)
            freed = True
    if freed:
        model.register_forward_pre_hook(_freed_model_called)
        model.register_state_dict_pre_hook(_freed_model_saved)
    _return_freed_memory()


def _freed_model_called(module: nn.Module, args) -> None:
    # an evaluation or a sample written as `model(x)` failed in some layer on the empty tensors
    # ("'weight' must be 2-D"), at P > 1 only
    raise ConfigError(
        f"this {type(module).__name__} was split into pipeline stages when Varuna took it: this worker holds "
        "one stage's weights, and the model object the others' as empty placeholders, so it cannot run forward",
        hint="evaluate through Varuna (varuna.evaluate(batch) runs the pipeline, in eval mode), and sample or "
             "generate from a model loaded from a checkpoint (varunactl export)")


def _freed_model_saved(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    # torch.save(model.state_dict()) and save_pretrained wrote the other stages' tensors as empty
    # ones, and the file failed only when loaded (a probe's GPT-2 at P = 2)
    raise ConfigError(
        f"this {type(module).__name__} was split into pipeline stages when Varuna took it: its state_dict "
        "would hold the other stages' weights as empty tensors, and a file saved from it would not load",
        hint="write the whole trained model from the job's newest checkpoint with `varunactl export JOB --out DIR` "
             "(`--store DIR` for a trainer.launch run), which also writes a Hugging Face model's "
             "save_pretrained directory")


def _return_freed_memory() -> None:
    """glibc keeps freed heap memory for the process's next allocations: the whole model's worth
    would stay resident in every worker. malloc_trim hands it back to the kernel (nothing where
    the C library has no such call)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def stream_security(endpoints: Sequence[str], keys: Mapping[str, str] | None) -> Security:
    """CURVE for the tensor streams unless the environment says plaintext or a trusted network
    (protocol.security.SecurityConfig.from_env); `keys` are the neighbours' server keys by
    endpoint (`WorkerAssignment.peer_keys`), "*" standing for any other endpoint."""
    keys = keys or {}
    try:
        peers = {ep: keys.get(ep, keys.get("*")) for ep in endpoints if keys.get(ep, keys.get("*"))}
        return Security(SecurityConfig.from_env(os.environ), peers=peers)
    except (SecurityError, ValueError) as exc:
        raise ConfigError(f"cannot secure the tensor streams: {exc}",
                          hint="start workers with trainer.launch or varunad, which set VARUNA_SECURITY "
                               "and the keys; VARUNA_SECURITY=plaintext only on a private machine") from exc


def shard_size(inputs: Mapping[str, torch.Tensor]) -> int:
    sizes = {k: v.shape[0] for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not sizes or len(set(sizes.values())) != 1:
        raise ConfigError(f"inputs must be batch-first tensors of one batch size, got {sizes}")
    return next(iter(sizes.values()))


# A symbolic size's range as the capture traced it: (lowest, highest or None for no bound)
Span = tuple[int, "int | None"]


def _span(size) -> Span | None:
    """The range torch.export recorded for a symbolic size (None: not a plain symbol of its own)."""
    node = getattr(size, "node", None)
    expr = getattr(node, "expr", None)
    ranges = getattr(getattr(node, "shape_env", None), "var_to_range", {})
    vr = ranges.get(expr) if expr is not None and expr.is_Symbol else None
    if vr is None:
        return None
    return (_bound(vr.lower) or 0, _bound(vr.upper))


def _bound(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):   # an infinity of sympy's or torch's
        return None


def captured_shapes(gm) -> dict[str, tuple[int | Span | None, ...]]:
    """Each batch input's shape after the batch dimension as the capture left it: an int where
    it fixed the size, the range it traced a symbolic size for, None where neither is known;
    from the graph's placeholders, empty where they carry none."""
    out = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            # a size the capture fixed may be a SymInt that is a number: fixed all the same
            out[node.target] = tuple(int(d) if is_concrete_int(d) else _span(d) for d in val.shape[1:])
    return out


def check_shapes(inputs: Mapping[str, torch.Tensor], captured: Mapping[str, tuple[int | Span | None, ...]],
                 sample: Mapping[str, tuple[int, ...]]) -> tuple[list[str], list[str]]:
    """ConfigError for a batch tensor whose shape after the batch dimension differs from the one
    the model was captured with where the model's code fixed it (a Linear over flattened tokens):
    the captured graph holds those sizes, and it would fail deep inside with an index error.
    Returns (what is larger than get_batch_fn's sample, by which the plan's memory was measured:
    "input_ids dimension 1: 14 > 13"; what lies outside the range the capture traced a size for,
    where forward may branch on it: "input_ids dimension 1: 4 < 8"), for warnings. Export's own
    floor of 2 (it fixes sizes 0 and 1) is no branch of the model's."""
    larger, outside = [], []
    for name, fixed in captured.items():
        t = inputs.get(name)
        if not isinstance(t, torch.Tensor):
            continue
        got = tuple(t.shape[1:])
        if len(got) != len(fixed) or any(type(f) is int and f != g for f, g in zip(fixed, got)):
            want = "[batch, " + ", ".join(str(f) if type(f) is int else "*" for f in fixed) + "]"
            one = any(type(f) is int and f == 1 and g != 1 for f, g in zip(fixed, got)) and \
                any(w == 1 for w in sample.get(name, ()))
            raise ConfigError(
                f"the batch's {name} has shape {list(t.shape)}, but the model was captured with {want}: "
                "the model's code fixes the sizes shown as numbers (those shown as * may vary from batch "
                "to batch)",
                hint=("get_batch_fn's sample has a size of 1 there, which the capture always fixes: return a "
                      "sample at least 2 long in every dimension" if one else
                      "pad every batch to those sizes (a tokenizer's padding='max_length' with max_length=), or "
                      "compute them in forward from the input (x.size(1)) rather than from constants"))
        for d, (g, f, w) in enumerate(zip(got, fixed, sample.get(name, got))):
            where = f"{name} dimension {d + 1}"
            if g > w:
                larger.append(f"{where}: {g} > {w}")
            if type(f) is tuple and ((f[1] is not None and g > f[1]) or (g < f[0] and f[0] > 2)):
                outside.append(f"{where}: {g} {'<' if g < f[0] else '>'} {f[0] if g < f[0] else f[1]}")
    return larger, outside


def uncompiled(model: nn.Module) -> nn.Module:
    """The module a `torch.compile`d model wraps, which Varuna captures itself (torch.export):
    the compiled wrapper takes its batch only through **kwargs and cannot be split into stages."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        log.warning("the model is torch.compile'd: Varuna captures and runs the module it wraps (%s) "
                    "with torch.export itself, so the compiled wrapper is set aside; pass the module "
                    "before torch.compile to silence this", type(inner).__name__)
        return inner
    return model
