"""The Varuna API: one worker's view of a P x D pipeline + data-parallel job.

A script written for Varuna ports with an import change:

    model = Varuna(model, None, get_batch_fn, batch_size=512, chunk_size=8)
    model.set_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    while model.iteration < steps:
        loss, overflow = model.step(shard_for(model.iteration))

Each worker captures the whole model (torch.export), keeps only its stage (the rest of the parameters are
freed), and runs the schedule's action list for its stage every step. Gradients are summed
over replicas (the loss is normalised by the global batch), so every P x D computes the same
update as a single process would, whether the replicas take even shares of the batch or the
plan's uneven ones ([Note: the global batch defines the math] in ARCHITECTURE.md).

When the epoch breaks (a peer lost mid-step), the step is abandoned and the state of the last
completed step is saved from memory for the next epoch (`_abandon`, trainer.checkpoint.rescue).

A step's whole life (run, agree, apply, checkpoint, abandon) acts on one worker's state and its
flags; `Varuna` is put together from the parts that act on it: its process groups
(trainer.engine.groups), the step's agreement and optimizer step (trainer.engine.agreement) and
its checkpoints (trainer.engine.checkpoints). What needs none of its state lives apart: setup,
executor, comm, reduction, precision, checkpoint contents.
"""

from __future__ import annotations

import atexit
import collections
import gc
import inspect
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import zmq
from torch import nn

from trainer.checkpoint import contents as checkpointing
from trainer.checkpoint import rescue
from trainer.checkpoint import store as ckpt_store
from trainer.checkpoint.model_record import record_model
from trainer.engine import hooks, replica_share, setup
from trainer.engine import weights as stage_weights
from trainer.engine.agreement import StepAgreement
from trainer.engine.checkpoints import WorkerCheckpoints
from trainer.engine.compute_clock import ComputeClock
from trainer.engine.control import STOPPED_EXIT_CODE, ControlClient, StepAbandoned, StepsDone, StopRequested
from trainer.engine.executor import StageExecutor
from trainer.engine.groups import ProcessGroups
from trainer.engine.memory import OUT_OF_MEMORY, PeakMemory
from trainer.engine.precision import LossScaler, Precision
from trainer.engine.store_outage import StoreHealth
from trainer.engine.trace import NullRecorder, recorder_for
from trainer.errors import CheckpointError, ConfigError, StoreOutage, WorkerError
from trainer.graph import loss_weights
from trainer.graph.keyed_rng import Draws
from trainer.graph.layout import Layout, build_layout
from trainer.graph.partition import capture_model, slice_stages
from trainer.graph.placement import retarget_graph
from trainer.planning.parallel import ParallelPlan, replica_slice
from trainer.planning.schedule import DEFAULT_SCHEDULE, Action, Kind, build_table
from trainer.worker_env import WorkerAssignment

__all__ = ["Varuna"]

log = logging.getLogger("varuna")

RECENT_LOSSES = 256   # steps whose losses each checkpoint's manifest carries
_TRACE_STEPS = 10   # unless the assignment says how many (WorkerAssignment.trace_steps)

# What a lost peer looks like from inside a step: a failed collective (gloo, NCCL), a peer that
# never answered (WorkerError), a broken socket, or the daemon saying the epoch is broken.
_BROKEN_EPOCH = (RuntimeError, WorkerError, zmq.ZMQError, StepAbandoned)


class Varuna(ProcessGroups, StepAgreement, WorkerCheckpoints):
    # Set only in a calibration run (VARUNA_PROFILE), which profiles at set_optimizer and exits.
    _calibration_run: hooks.CalibrationRunHook | None = None

    def __init__(self, model: nn.Module, stage_to_rank_map: Mapping[int, Sequence[int]] | None,
                 get_batch_fn: Callable[[int, torch.device | str], Mapping[str, torch.Tensor]],
                 batch_size: int, chunk_size: int, fp16: bool = False, local_rank: int = -1,
                 device: int | str = -1, shared_weights: Sequence[tuple[str, str]] | None = None,
                 from_cache: bool = True, *, precision: Precision | None = None,
                 schedule: str | None = None, recompute: bool | None = None,
                 weights: str | os.PathLike[str] | None = None,
                 assignment: WorkerAssignment | None = None, seed: int = 0,
                 loss_count: loss_weights.Counter | str | None = "auto") -> None:
        model = setup.uncompiled(model)
        self.assignment = assignment or setup.assignment_for(stage_to_rank_map)
        # what a micro-batch's loss weighs: its examples, or the tokens its loss averages (trainer.graph.loss_weights);
        # "auto" reads the captured graph's loss, below
        self._counter = loss_weights.counter_for(model, loss_count) if loss_count != "auto" else None
        a = self.assignment
        if a.profile:
            # the whole model passes through host memory while it is calibrated
            stage_weights.load_stage(model, setup.all_tensors(model), weights, torch.device("cpu"),
                                     tied=shared_weights or ())
            # a micro-batch the job fixed at submit is measured too: the planner may choose no other
            self._begin_calibration_run(model, get_batch_fn, batch_size, int(a.plan.micro_batch_size or chunk_size),
                                        precision or ("fp16" if fp16 else "fp32"),
                                        setup.choose_device(a, local_rank, device))
            return
        self.rank = a.rank
        self.plan = a.plan   # as started; `cuts`, `schedule`, `recompute` below are what this worker runs
        self.stage, self.replica = a.position()
        self.batch_size, self.micro_batch_size = int(batch_size), int(a.plan.micro_batch_size or chunk_size)
        if a.batch_size is not None and a.batch_size != self.batch_size:
            raise ConfigError(f"the job was submitted with global batch {a.batch_size}, the script passes "
                              f"batch_size={self.batch_size} to Varuna",
                              hint="make the script read the batch size it is given, or submit it with the script's")
        self.precision: Precision = precision or ("fp16" if fp16 else "fp32")
        self.schedule = schedule or a.plan.schedule or DEFAULT_SCHEDULE
        # An explicit argument wins; else the planner's per-stage choice; else recompute everywhere.
        self.recompute: bool | tuple[bool, ...] = (
            recompute if recompute is not None else a.plan.recompute if a.plan.recompute is not None else True)
        self.iteration = 0
        # the newest steps' losses, written into each checkpoint's manifest: a daemon that dies right
        # after a checkpoint may not have written them into the loss history yet (varunad.control.resume)
        self.recent_losses: collections.deque[tuple[int, float]] = collections.deque(maxlen=RECENT_LOSSES)
        self.seed = seed   # keys the model's random ops with the step and example (trainer.graph.keyed_rng)
        setup.check_sizes(self.batch_size, self.micro_batch_size, self.plan.D, self.precision, self.schedule,
                          self.plan.shares)
        # where this replica's examples are in each step's global batch: they key its random draws
        self.shard_offset, self.shard_size = replica_slice(self.batch_size, self.plan.D, self.plan.shares,
                                                           self.replica)
        if a.threads:
            torch.set_num_threads(a.threads)
        self.device = setup.choose_device(a, local_rank, device)
        self._init_distributed()
        atexit.register(self.close)

        # The model's construction leaves hundreds of thousands of long-lived objects; every full
        # collection (Python's own during training, ours in close(), the interpreter's at exit)
        # would walk them again: seconds per worker exit on a loaded host. Frozen before the
        # capture, so that the collection after it walks only what the capture made. Only in a
        # worker process of its own (the daemon's or the launcher's), never in a program that
        # builds one Varuna after another.
        own_process = bool(a.control or a.world_size > 1)
        if own_process:
            gc.freeze()
        captured_on = setup.device_of(model)   # meta for a model materialized stage by stage from `weights`
        started = time.perf_counter()
        sample = get_batch_fn(self.micro_batch_size, captured_on)
        # the sizes the plan's memory and time were measured at: a longer batch is warned of
        self._sample_shapes = {k: tuple(v.shape[1:]) for k, v in sample.items() if isinstance(v, torch.Tensor)}
        self._warned_larger = False
        self._warned_outside: set[str] = set()
        traced = capture_model(model, sample, cache_dir=a.capture_cache)
        del sample
        log.info("rank %d: model %s in %.2f s", self.rank,
                 "loaded from the capture cache" if traced.reused else "captured", time.perf_counter() - started)
        if loss_count == "auto":
            self._counter = loss_weights.counter_for(model, loss_count, traced.graph_module)
        cuts = self._agree_on_cuts(traced, get_batch_fn)
        slices = slice_stages(traced, cuts)
        aliases = setup.aliases(model, traced.canonical)
        # the user's state_dict names, recorded in every checkpoint for an export
        self.model_record = record_model(model, traced.canonical)
        self.layout: Layout = build_layout(traced, slices, shared_weights or (), aliases,
                                           state=self.model_record.state_dict.values())
        self.cuts = cuts
        mine = slices[self.stage]
        self.module = mine.module
        self.model_inputs = traced.input_names   # every argument of forward, in its order: what step() takes
        self._shapes = setup.captured_shapes(traced.graph_module)
        # what forward never uses is kept by stage 0, untrained (as a plain loop leaves it), for the checkpoints
        self._untrained = self.layout.untrained if self.stage == 0 else frozenset()
        self._named = setup.named_tensors(model, traced.canonical, mine, also=self._untrained)
        setup.free_other_stages(model, traced.canonical, set(self._named))
        del traced, slices
        self._named = stage_weights.load_stage(model, self._named, weights, self.device, tied=self.layout.tied,
                                               holders=(self.module,))
        setup.move_in_place(self._named.values(), self.device)
        self.module.to(self.device)   # what else the slice holds (graph constants)
        retarget_graph(self.module, captured_on, self.device)   # and the devices its ops recorded
        self.input_names = mine.input_names

        # torch.export leaves reference cycles (its wrapper module, its tracer) that hold the
        # user's whole model: frozen, they would keep every stage's weights alive in every worker
        # after the script drops its model. Collected here, where the collection walks only what
        # the capture made; then the rest is frozen too, before the groups and the reducer exist,
        # whose cycles close() must still collect.
        if own_process:
            gc.collect()
            gc.freeze()
        # from here on the stage trains: its peak is measured beside the planner's estimate
        self.memory = PeakMemory(self.device)
        self._build_groups()
        # Where this worker sends its step statistics and whose it gathers (see `_agree`).
        self._stats_parent, self._stats_children = setup.stats_tree(a.plan, self.stage, self.replica)
        # Pure data parallelism (P = 1) opens one too: the step's statistics travel on it.
        self.channel = self._open_channel() if a.world_size > 1 else None
        self.recorder = recorder_for(a.trace_dir or None, rank=a.rank, stage=self.stage, replica=self.replica)
        self._traced_steps = 0  # counted per process: a resumed epoch starts past step _TRACE_STEPS
        self.executor = StageExecutor(self.module, stage=self.stage, stages=self.plan.P,
                                      takes_activation=mine.takes_activation, channel=self.channel,
                                      device=self.device, precision=self.precision, recorder=self.recorder)
        self._tables: dict[tuple[str, int, bool], list[Action]] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None
        self.scaler = LossScaler()
        self.grad_norm = 0.0
        self._upload: checkpointing.Upload | None = None   # a staged checkpoint on its way to the store
        # a staged checkpoint started since the workers last told each other how their shares went
        # (`_compare_shares`), and whether this worker's share of it failed
        self._shares_unsettled = self._share_failed = False
        self.control = ControlClient(a.control, job=a.job, epoch=a.epoch, rank=a.rank)
        self.store_health = StoreHealth(rank=a.rank, report=self.control.store_outage,
                                        recovered=self.control.store_recovered)
        self._agreed = {"checkpoint": False, "stop": False}
        # Where the state stands within a step (see `_abandon`): the optimizer is applying it, or
        # has applied it before the step returned.
        self._applying = self._applied = False
        self._held_since = 0              # the iteration the state came from (init or a checkpoint)
        self._scheduler_steps: int | None = None   # the scheduler's last_epoch as this engine left it
        self._scheduler_checked = False   # whether the first step looked for a scheduler it was not given
        log.info("rank %d: stage %d/%d replica %d/%d, %d parameters (%.1f MB), cuts %s",
                 self.rank, self.stage, self.plan.P, self.replica, self.plan.D,
                 sum(p.numel() for p in self.parameters()), self.parameter_bytes() / 2**20, cuts)

    # -- public API ----------------------------------------------------------------------------

    def parameters(self) -> list[nn.Parameter]:
        """This stage's parameters (each once), the ones to give the optimizer."""
        return [p for _, p in self.named_parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, t) for n, t in self._named.items() if isinstance(t, nn.Parameter) and n not in self._untrained]

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def set_optimizer(self, optimizer: torch.optim.Optimizer, loss_scale: float | str = "dynamic",
                      init_loss_scale: float = 2.0**20, min_loss_scale: float = 1.0,
                      lr_scheduler=None) -> None:
        """`lr_scheduler`, if given, is stepped by `step()` after each optimizer step it applies
        (an fp16 step skipped for overflow does not advance it), and checkpointed with it, so a
        resumed job uses the learning rate the uninterrupted one would have."""
        if self._calibration_run is not None:   # profiles with this optimizer and ends the script
            self._calibration_run.run(optimizer, dynamic_loss_scale=self.precision == "fp16" and loss_scale == "dynamic")
        mine = {id(p) for p in self.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
        if foreign:
            raise ConfigError(f"the optimizer holds {len(foreign)} parameters that this stage does not own",
                              hint="build it from varuna.parameters(), after creating Varuna")
        _check_scheduler(lr_scheduler)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        if self.precision == "fp16":
            self.scaler = LossScaler(loss_scale, init_loss_scale, min_loss_scale)
        else:
            self.scaler = LossScaler(1.0, 1.0, 1.0)
        a = self.assignment
        if a.resume == "latest":
            try:   # the fence must be written before anything loads: held here through an outage
                newest = self.store_health.until_written(lambda: checkpointing.resume_point(self, a.store),
                                                         self.iteration, "the new epoch's fence",
                                                         give_up=self._stop_asked)
            except StoreOutage as exc:
                log.warning("rank %d: stopping as asked while the store refused the epoch fence", self.rank)
                raise StopRequested(self.iteration) from exc
            if newest is not None:
                self.load_checkpoint(a.store, newest)
                log.info("rank %d: resumed from checkpoint %d", self.rank, newest)
        self._held_since = self.iteration
        self._scheduler_steps = getattr(lr_scheduler, "last_epoch", None)
        self._scheduler_checked = False
        self.control.idle_rescue = self._rescue_if_asked

    def step(self, inputs: Mapping[str, torch.Tensor], clip_grad_max_norm: float | None = None
             ) -> tuple[float, bool]:
        """One optimizer step on the global mini-batch; `inputs` is this replica's shard: its share
        of the global batch (`shares`), or the even one of B / D examples, which works with any plan."""
        self.control.in_step = True   # a rescue asked for meanwhile is this step's to act on
        try:
            return self._step(inputs, clip_grad_max_norm)
        finally:
            self.control.in_step = False

    def _step(self, inputs: Mapping[str, torch.Tensor], clip_grad_max_norm: float | None) -> tuple[float, bool]:
        if self.optimizer is None:
            raise ConfigError("step() before set_optimizer()")
        if not isinstance(inputs, Mapping):
            raise ConfigError(f"step() takes a dict of batch-first tensors keyed by forward's argument names "
                              f"({', '.join(self.model_inputs)}), got a {type(inputs).__name__}",
                              hint="pass {name: tensor}, e.g. dict(zip(%r, batch))" % (tuple(self.model_inputs),))
        self._rescue_if_asked()
        last = self.assignment.steps
        if last is not None and self.iteration >= last:
            log.error("rank %d: step() called for step %d, past the last of the job's %d steps (its --steps, "
                      "VARUNA_STEPS): the script ends here, as the job does; loop `while varuna.iteration < "
                      "job_setting('steps', N)` (trainer.worker_env) so that the job's steps decide",
                      self.rank, self.iteration, last)
            raise StepsDone(self.iteration)
        if not self._scheduler_checked:
            self._scheduler_checked = True
            _check_unregistered_scheduler(self.optimizer, self.lr_scheduler, self.iteration, self.rank)
        self.recorder.set_step(self.iteration)
        start = time.perf_counter()
        waited = self.channel.wait_s if self.channel is not None else 0.0
        self.optimizer.zero_grad(set_to_none=True)
        result: dict[str, object] = {}
        clock = ComputeClock(self.channel, self.device)
        try:
            self.control.abandonable = True
            # under uneven shares the stage's replicas trade inputs first: a peer lost there breaks
            # the epoch like one lost mid-schedule
            micro, sizes = self._micro_batches(inputs)
            weights = self._loss_weights(micro, [n / self.batch_size for n in sizes], clock)
            table = self._table(self.schedule, len(micro), self.recompute)
            draws = self._draws(sizes, self.shard_offset)
            self.executor.run(
                table, micro, weights, loss_scale=self.scaler.scale,
                handlers={Kind.ALLREDUCE: clock.apart(self._allreduce),
                          Kind.STEP: clock.apart(lambda: result.update(self._optimizer_step(clip_grad_max_norm)))},
                before_last_backward=self.reducer.arm,
                draws=draws,
            )
        except OUT_OF_MEMORY as exc:   # before _BROKEN_EPOCH: CUDA's is a RuntimeError, and this is no lost peer
            raise self.memory.out_of_memory(self.stage, self.plan.P, exc) from exc
        except _BROKEN_EPOCH as exc:
            self._abandon(exc)
            raise
        finally:
            self.control.abandonable = False
        computed_s = clock.computed_s()
        self.recent_losses.append((self.iteration, float(result["loss"])))
        self.iteration += 1
        self._applied = False
        if self.recorder.enabled:
            self._traced_steps += 1
            try:
                self.recorder.save()
            except OSError as exc:   # traces live in the job's store, which may be full: they are not the job
                log.warning("rank %d: not tracing any more steps: %s", self.rank, exc)
                self._traced_steps = self.assignment.trace_steps or _TRACE_STEPS
            # a few steps show the schedule; more only grow the file
            if self._traced_steps >= (self.assignment.trace_steps or _TRACE_STEPS):
                self.recorder = self.executor.recorder = NullRecorder()
        elapsed = time.perf_counter() - start
        blocked = (self.channel.wait_s if self.channel is not None else 0.0) - waited
        # per micro-batch of the plan's size, what the leader expects of the stage, whatever share
        # this replica took and however small its last micro-batch
        per_micro_batch = computed_s * self.micro_batch_size / self.shard_size
        self.control.progress(self.iteration - 1, result["loss"], self.batch_size / elapsed,
                              1.0 - blocked / elapsed, self.memory.peak_bytes(), per_micro_batch)
        try:
            self.control.abandonable = True   # a checkpoint's collectives: the state is the step's, whole
            self._after_step()
        except _BROKEN_EPOCH as exc:
            self._abandon(exc)
            raise
        finally:
            self.control.abandonable = False
        self._rescue_if_asked()
        return result["loss"], result["overflow"]

    def _after_step(self) -> None:
        """Checkpoint every K steps and when any worker was asked to; stop when asked. The
        decision was agreed in the step's all-reduce, so every worker takes the same branch."""
        a = self.assignment
        periodic = a.checkpoint_every is not None and self.iteration % a.checkpoint_every == 0
        # The job's last step always ends in a checkpoint: the daemon counts a job done only when
        # the checkpoint of its last step is complete (a script that stops early is not done).
        final = a.steps is not None and self.iteration == a.steps
        if self._upload is not None and self._upload.done():
            self._settle_upload()
        if a.store and (periodic or final or self._agreed["checkpoint"]):
            start = time.perf_counter()
            path = self._write_checkpoint(on_demand=self._agreed["checkpoint"] or final)
            if path is not None and self._upload is None:   # written in place: complete now
                self.control.checkpointed(self.iteration, path, time.perf_counter() - start)
            self.control.clear()
            if path is not None and self.rank == 0:
                try:
                    ckpt_store.prune(a.store, a.keep_checkpoints)
                except StoreOutage as exc:   # housekeeping: the next checkpoint prunes again
                    log.warning("rank %d: could not prune old checkpoints: %s", self.rank, exc)
        if self._agreed["stop"]:
            log.warning("rank %d: stopping after step %d as asked", self.rank, self.iteration - 1)
            self.close()
            raise StopRequested(self.iteration)

    @torch.no_grad()
    def evaluate(self, inputs: Mapping[str, torch.Tensor], batch_size: int | None = None) -> float:
        """Global mean loss of an evaluation batch (this replica's shard in `inputs`; `batch_size`,
        the whole batch's, defaults to the sum of the replicas' shards)."""
        shard = setup.shard_size(inputs)
        total, first = self._evaluation_split(shard, batch_size)
        micro, sizes = self._micro_batches(inputs, as_training=total == self.batch_size)
        weights = self._loss_weights(micro, [n / total for n in sizes])
        actions = []
        for m in range(len(micro)):
            if self.stage > 0:
                actions.append(Action(self.stage, Kind.RECV_ACT, m))
            actions.append(Action(self.stage, Kind.FORWARD, m))
            if self.stage < self.plan.P - 1:
                actions.append(Action(self.stage, Kind.SEND_ACT, m))
        local = self.executor.run(actions, micro, weights, training=False,
                                  draws=self._draws(sizes, first, training=False))
        out = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(out)
        return float(out[0])

    def _evaluation_split(self, shard: int, batch_size: int | None) -> tuple[int, int]:
        """(the evaluation batch's size, the global index of this replica's first example). Under
        uneven shares a replica's shard says nothing of the others', so the stage's replicas tell
        each other theirs; a batch of the training size is split as training's is (`_this_share`)."""
        if batch_size is None and replica_share.is_uneven(self.plan.shares):
            sizes = replica_share.gathered_sizes(shard, self.stage_group, self._replica_order)
            total, first = sum(sizes), sum(sizes[:self.replica])
        else:
            total, first = batch_size or shard * self.plan.D, self.replica * shard
        return total, self.shard_offset if total == self.batch_size else first

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer this stage owns, by its name in the user's model."""
        return self._named

    def _abandon(self, exc: BaseException) -> None:
        """The epoch broke inside a step: keep the state of the last completed step, save it from
        memory for the next epoch (trainer.checkpoint.rescue), and leave; the caller re-raises a
        failure. Nothing is saved when the failure hit the optimizer half-way through the step."""
        self.control.abandonable = False
        if self._applying:
            log.error("rank %d: the epoch broke while the optimizer applied step %d: this worker's state is "
                      "half-updated and is not saved", self.rank, self.iteration)
            return
        if self._applied:   # the step was applied before the failure: the state is the next one
            self.iteration += 1
            self._applied = False
        log.warning("rank %d: abandoning step %d: %s", self.rank, self.iteration, str(exc).splitlines()[0][:300]
                    if str(exc) else type(exc).__name__)
        self._rescue()
        if self.assignment.control:
            self._leave(exc)
        if isinstance(exc, StepAbandoned):
            raise StopRequested(self.iteration) from exc

    def _leave(self, exc: BaseException) -> None:
        """Exit now, under the daemon, once a broken epoch's state is saved: tearing the process
        group down waits on collectives a dead peer will never join, and the daemon must see this
        worker gone (a failure: the leader acts on it at once; a stop it asked for: 75)."""
        traceback.print_exception(exc)
        if self._upload is not None:
            # its copy may still finish; not its commit if a writer died: that one never comes
            self._upload.wait(timeout=5.0)
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(STOPPED_EXIT_CODE if isinstance(exc, StepAbandoned) else 1)

    def _rescue_if_asked(self) -> None:
        """A rescue asked for between steps, or while the optimizer applied one: the state is whole."""
        if self.control.rescue_requested:
            self._abandon(StepAbandoned("the daemon says this epoch is broken"))

    def _rescue(self) -> None:
        a = self.assignment
        if not a.store or self.iteration == self._held_since:
            return   # nothing newer than what the store (or the initialisation) already gives
        self.control.rescuing(self.iteration)
        try:
            saved = rescue.save_from_memory(self, a.store)
        except (CheckpointError, OSError) as exc:
            log.error("rank %d: could not save step %d from memory: %s", self.rank, self.iteration, exc)
            return
        log.warning("rank %d: saved this stage's state of step %d from memory (%s)", self.rank, self.iteration,
                    f"the checkpoint is complete: {saved}" if saved else "other stages' survivors complete it")

    def close(self) -> None:
        """Release sockets and the process group; also run at interpreter exit."""
        # getattr: a constructor that failed half-way registered this already
        if getattr(self, "control", None) is not None:
            # a rescue signal from here on saves nothing and raises nothing: this worker is done
            # with its state, and a close cut short by it left its sockets' last messages unsent
            self.control.idle_rescue = None
            self.control.abandonable = False
        if getattr(self, "_upload", None) is not None:
            self._settle_upload()   # a staged checkpoint must not die with the process
        if getattr(self, "channel", None) is not None:
            self.channel.close()
            self.channel = None
        if getattr(self, "control", None) is not None:
            self.control.close()
        # gloo's threads must be joined before the interpreter tears down, or C++ aborts
        # ("terminate called without an active exception") and the worker exits non-zero.
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            # The groups' C++ objects (and their threads) live as long as a Python reference
            # does; the reducers' hooks on the parameters hold some until interpreter teardown.
            if getattr(self, "reducer", None) is not None:
                self.reducer.release()
            self.stage_group = None
            gc.collect()
        if getattr(self, "_rendezvous", None) is not None:
            self._rendezvous.close()
            self._rendezvous = None

    # -- internals -----------------------------------------------------------------------------

    def _begin_calibration_run(self, model: nn.Module, get_batch_fn, batch_size: int, chunk_size: int,
                               precision: Precision, device: torch.device) -> None:
        """A calibration run: the script sees a lone worker holding the whole model until it sets
        its optimizer, which is then profiled with the model (trainer.profiler.calibration_run,
        reached through trainer.engine.hooks)."""
        if hooks.calibration_run is None:
            raise ConfigError("VARUNA_PROFILE is set but no calibration run is wired into the engine",
                              hint="import the package `trainer` (it sets trainer.engine.hooks.calibration_run)")
        self._calibration_run = hooks.calibration_run(model, get_batch_fn, self.assignment, batch_size,
                                                      chunk_size, precision, device)
        atexit.register(self._calibration_run.check_done)
        self.rank, self.stage, self.replica = 0, 0, 0
        self.plan = ParallelPlan(P=1, D=1)
        self.batch_size, self.micro_batch_size = int(batch_size), int(chunk_size)
        self.shard_offset, self.shard_size = 0, self.batch_size
        self.precision, self.device, self.iteration = precision, device, 0
        self.optimizer = None
        self._named = dict(model.named_parameters())
        self._untrained = frozenset()

    # The script's names for P and D (the original Varuna API's): `GlobalBatches.shard` takes D.
    @property
    def pipeline_depth(self) -> int:
        return self.plan.P

    @property
    def data_depth(self) -> int:
        return self.plan.D

    @property
    def shares(self) -> tuple[int, ...] | None:
        """The examples of the global batch each replica takes per step, in replica order (the
        plan's; None: B / D each). A script may pass them to `GlobalBatches.shard` to hand each
        replica its own share; the even shard works as well (`_micro_batches`)."""
        return self.plan.shares

    def _table(self, name: str, m: int, recompute: bool) -> list[Action]:
        key = (name, m, recompute)
        if key not in self._tables:
            self._tables[key] = build_table(name, self.plan.P, m, recompute)[self.stage]
        return self._tables[key]

    def _micro_batches(self, inputs: Mapping[str, torch.Tensor], *, as_training: bool = True):
        """This stage's micro-batches of `inputs` (its shard; split as training splits it, its share
        under uneven shares, where `as_training`), and how many examples each holds."""
        shard = setup.shard_size(inputs)
        wanted = {k: v for k, v in inputs.items() if k in self.input_names}
        if as_training:
            wanted, shard = self._this_share(wanted, shard)
        missing = set(self.input_names) - set(wanted)
        if missing:
            raise ConfigError(f"the batch lacks {sorted(missing)}, which forward takes (it takes "
                              f"{', '.join(self.model_inputs)}; stage {self.stage} reads {sorted(missing)})")
        # every captured input, not only this stage's: a batch one stage refused and another ran
        # put the pipeline out of step (the next batch's activations met this one's labels)
        larger, outside = setup.check_shapes(inputs, self._shapes, self._sample_shapes)
        if larger and not self._warned_larger:
            self._warned_larger = True
            log.warning("rank %d: step %d's batch is larger than get_batch_fn's sample (%s): the plan's memory "
                        "and step time were measured with the sample, so a worker may run out of memory; make "
                        "the sample as large as the largest batch (said once)", self.rank, self.iteration,
                        "; ".join(larger))
        for where in outside:
            if where.split(":")[0] not in self._warned_outside:
                self._warned_outside.add(where.split(":")[0])
                log.warning("rank %d: step %d's batch has %s, outside the sizes the captured model was traced "
                            "for: forward took its branches for the sample's size (an `if x.size(1) < n:` is "
                            "captured as the sample took it), so this batch may be computed differently from "
                            "the plain model; give get_batch_fn a sample on the other side, or pad to it (said "
                            "once per input)", self.rank, self.iteration, where)
        micro, sizes = [], []
        for start in range(0, shard, self.micro_batch_size):
            micro.append({k: v[start:start + self.micro_batch_size].to(self.device, non_blocking=True)
                          for k, v in wanted.items()})
            sizes.append(min(self.micro_batch_size, shard - start))
        return micro, sizes

    def _loss_weights(self, micro: list[dict[str, torch.Tensor]], weights: list[float],
                      clock: ComputeClock | None = None) -> list[float]:
        """The micro-batches' weights: `weights` (by examples), or on the last stage, where a counter
        counts the tokens each loss averages, by tokens over the global batch's, which the stage's
        replicas add up (only the last stage weighs its losses; the others back-propagate them)."""
        if self.stage != self.plan.P - 1:
            return weights

        def global_count(mine: float) -> float:
            total = torch.tensor([mine], dtype=torch.float64)

            def add_up() -> None:
                dist.all_reduce(total, group=self.stage_group)

            if self.plan.D > 1:
                # a wait for a slower replica, not this stage's compute: counted as compute, it made
                # every replica as slow as the slowest, and no straggler was ever named
                (clock.apart(add_up) if clock is not None else add_up)()
            return float(total[0])

        return loss_weights.step_weights(self._counter, micro, weights, global_count)

    def _this_share(self, wanted: dict[str, torch.Tensor], shard: int) -> tuple[dict[str, torch.Tensor], int]:
        """This replica's examples of the step's global batch, from the `shard` of them the script
        passed: its share as the plan gives it, or, with uneven shares, the even shard, which the
        stage's replicas trade for their shares (trainer.engine.replica_share)."""
        shares = self.plan.shares
        if not replica_share.is_uneven(shares):
            if shard != self.shard_size:
                raise ConfigError(f"step() got {shard} examples; this replica's shard of the global batch "
                                  f"{self.batch_size} over {self.plan.D} replicas is {self.shard_size}",
                                  hint="pass GlobalBatches(...).shard(step, varuna.replica, varuna.data_depth)")
            return wanted, shard
        if set(self.input_names) - set(wanted):
            # the caller refuses it before any collective; the stage's replicas run one script, so
            # they lack the same inputs and all refuse
            return wanted, shard
        mine = replica_share.share_of(wanted, shard, batch=self.batch_size, shares=shares, replica=self.replica,
                                      offset=self.shard_offset, group=self.stage_group, order=self._replica_order)
        return mine, self.shard_size

    def _draws(self, sizes: list[int], first: int, training: bool = True) -> list[Draws]:
        """The key of each micro-batch's random ops: the step, the global index of its first
        example (`first`: where this replica's examples start in the global batch, a contiguous
        slice: `replica_slice`) and how many it holds."""
        return [Draws(self.seed, self.iteration, first + i * self.micro_batch_size, training, examples=n)
                for i, n in enumerate(sizes)]

    def _allreduce(self) -> None:
        self.reducer.reduce()


def _schedulers_of(optimizer: torch.optim.Optimizer) -> list:
    """torch's learning-rate schedulers built on `optimizer`: found by what refers to it, the
    scheduler itself or, once its attributes live in a dict of their own (a load_state_dict made
    one), that dict, whose owner is the scheduler."""
    kind = torch.optim.lr_scheduler.LRScheduler
    found = []
    for ref in gc.get_referrers(optimizer):
        if isinstance(ref, kind) and getattr(ref, "optimizer", None) is optimizer:
            found.append(ref)
        elif isinstance(ref, dict) and ref.get("optimizer") is optimizer:
            found += [o for o in gc.get_referrers(ref) if isinstance(o, kind) and getattr(o, "__dict__", None) is ref]
    return list({id(o): o for o in found}.values())


def _check_unregistered_scheduler(optimizer: torch.optim.Optimizer, lr_scheduler, iteration: int, rank: int) -> None:
    """A torch learning-rate scheduler built on `optimizer` but not given to set_optimizer is
    stepped by the script and saved by no checkpoint: a resumed run starts its schedule over (a
    probe's warmup restarted at step 5, and the losses went another way, with no word). Said by
    rank 0 at a fresh run's first step, and at a resumed run's where such a scheduler is at its
    start: an error line, which the daemon's log shipper makes a warning of `varunactl status`
    (varunad.node.log_shipper). Not refused: a scheduler stepped once per pass over the data is
    rightly at its start during the first pass; and one that is no torch scheduler (timm's
    computes its rate from the step it is given) is left alone."""
    if lr_scheduler is not None or rank != 0 or not any("initial_lr" in g for g in optimizer.param_groups):
        return
    found = _schedulers_of(optimizer)
    if not found:
        return
    hint = ("one stepped after every step: pass it as set_optimizer(opt, lr_scheduler=sched) and drop the loop's "
            "sched.step() (Varuna steps, checkpoints and restores it); one stepped once per pass over the data: "
            "save its state_dict() with the script's own files and load it when varuna.iteration > 0")
    name = type(found[0]).__name__
    if iteration == 0:
        log.warning("the learning-rate scheduler %s was built on this optimizer but not given to set_optimizer: no "
                    "checkpoint holds its state, so a resumed run (every morph under varunad) would start its "
                    "schedule over; %s", name, hint)
    elif any(getattr(o, "last_epoch", 0) == 0 for o in found):
        log.error("learning-rate schedule started over: %s, a scheduler not given to set_optimizer, is at its start "
                  "in this run, resumed at step %d, so its learning rates are not the uninterrupted run's (unless "
                  "it is stepped once per pass over the data and this is the first); %s", name, iteration, hint)


def _check_scheduler(lr_scheduler) -> None:
    """ConfigError for a scheduler step() cannot step: one whose step needs an argument
    (ReduceLROnPlateau's metric, which only the script measures) failed at the first step."""
    if lr_scheduler is None:
        return
    step = getattr(lr_scheduler, "step", None)
    if not callable(step):
        raise ConfigError(f"lr_scheduler={type(lr_scheduler).__name__} has no step() method")
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):
        return
    needed = [p.name for p in params if p.default is inspect.Parameter.empty
              and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if needed:
        raise ConfigError(
            f"lr_scheduler={type(lr_scheduler).__name__}: its step() needs {', '.join(needed)}, which Varuna's "
            "step() does not have, so Varuna cannot step it",
            hint="leave it out of set_optimizer and step it yourself with the metric (e.g. after evaluate()); "
                 "save its state_dict() with your own files, since Varuna's checkpoints will not hold it")
