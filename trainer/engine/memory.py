"""A worker's measured memory: the peak its training reached, beside the planner's estimate.

The model's build is left out (the whole model may pass through host memory while it is built,
and the capture's machinery stays resident): the meter starts once the stage is built. On CUDA
the peak is `torch.cuda.max_memory_allocated`, reset there, which counts the stage's weights
already on the device. On a CPU the device is the host, and the slot's memory holds the whole
worker process: the interpreter, torch, the script's libraries and data, beside the stage's
tensors (about 250-350 MB on this project's hosts, more than a small stage). The peak is then
the process's resident high-water mark, reset once the stage is built when the kernel allows
it (/proc/self/clear_refs), so what the build touched and freed is not counted; and the
calibration measures the process's part (`process_bytes`), which the planner promises every
CPU stage beside its tensors (the calibration's `worker_bytes`).

An allocator keeps memory it freed (glibc under the workers' malloc settings, CUDA's cache), so
the measured peak is what the process held, the number a slot's budget must cover.

A worker on a CPU has glibc hand every block of 1 MiB or more back to the kernel once freed
(`return_freed_blocks`, when this module is imported, before the script builds its model): the
planner's estimate counts the tensors a stage holds, and glibc's heap, which keeps freed blocks
for reuse, held up to twice that for the same stage from one run to the next (180 to 358 MB for
a stage whose tensors peak at 171 MB: two 2048 x 2048 float32 layers' training state and Adam's
temporaries). Memory then follows the live tensors, at the price of faulting in fresh pages for
each large tensor a step allocates: measured on that stage, one worker's step took 14% longer
(0.237 -> 0.270 s), four such workers on two busy cores up to twice as long. A slot whose worker
the kernel kills for memory loses more than that. It is set at import, not once the stage is
built, because glibc serves a large request from the heap's free blocks before it maps new
memory: set later, the blocks the build freed (the other stages' weights) are reused and kept
(a peak of 213 MB on the same stage).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable, Mapping

import torch

from trainer.errors import VarunaError
from trainer.worker_env import env_name

__all__ = [
    "OUT_OF_MEMORY",
    "PeakMemory",
    "StageOutOfMemoryError",
    "process_bytes",
    "resident_bytes",
    "storage_bytes",
    "return_freed_blocks",
]

log = logging.getLogger("varuna")

# What running out looks like from inside a step: CUDA's allocator, or the host's (a CPU tensor
# the allocator could not get; the kernel's OOM killer sends SIGKILL instead, seen by the daemon).
OUT_OF_MEMORY: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError, MemoryError)


class StageOutOfMemoryError(VarunaError, MemoryError):
    """A stage needed more memory than its device had. The daemon's leader re-plans the job with
    less of that kind of slot's memory counted as usable; the message names the stage and its
    measured peak so that the leader (and a user) can set it beside the planner's estimate."""

    def __init__(self, stage: int, stages: int, device: torch.device, peak_bytes: int, detail: str) -> None:
        self.stage, self.peak_bytes = stage, peak_bytes
        first = detail.splitlines()[0][:200] if detail else ""
        super().__init__(f"stage {stage} of {stages} ran out of memory on {device} (measured peak "
                         f"{peak_bytes / 1e6:.1f} MB before it failed): {first}",
                         hint="the plan counted on more memory than the slot has: under varunad the job is "
                              "re-planned with less memory per slot of this kind; with trainer.launch use more "
                              "stages (-P) or a smaller micro-batch")


def resident_bytes(field: str = "VmRSS") -> int | None:
    """This process's resident size (VmRSS) or its high-water mark (VmHWM) in bytes; None where
    /proc is not there."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages under `tensors`, each once (tied weights, views and gradients that
    share one count once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def process_bytes(model: torch.nn.Module) -> int:
    """What this process holds in host memory beyond `model`'s tensors: its resident size less
    the bytes of the model's parameters and buffers in host memory (each storage once; tensors
    on a GPU or the meta device hold none of it). 0 where /proc is not there."""
    rss = resident_bytes()
    if rss is None:
        return 0
    # a sparse tensor has no one storage
    host = [t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu" and t.layout == torch.strided]
    return max(0, rss - storage_bytes(host))


_M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter (malloc.h)
FREED_BLOCK_BYTES = 1 << 20


def return_freed_blocks(threshold: int = FREED_BLOCK_BYTES) -> bool:
    """Make glibc map each allocation of `threshold` bytes or more on its own, so that freeing
    it returns it to the kernel (the environment's MALLOC_MMAP_THRESHOLD_ is overridden from
    here on). False where the C library has no mallopt."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def _a_cpu_worker(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a worker or a calibration run (its assignment is in the
    environment) whose device is the host."""
    if not environ.get(env_name("plan")) and not environ.get(env_name("profile")):
        return False   # an empty variable is an unset one (trainer.worker_env)
    device = environ.get(env_name("device"), "")
    return device in ("cpu", "-1") or (device == "" and not torch.cuda.is_available())


if _a_cpu_worker():
    return_freed_blocks()


def _reset_high_water() -> bool:
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")   # resets VmHWM to the current resident size
        return True
    except OSError:
        return False


# device type -> the peak before the resets that measurements made inside a meter's span
_carried: dict[str, int] = {}


def device_peak(device: torch.device) -> int | None:
    """The mark since the last reset: CUDA's allocation peak, or the process's resident
    high-water mark on a CPU (None where /proc is not there)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resident_bytes("VmHWM")


def reset_peak(device: torch.device) -> bool:
    """Start a measurement of `device`'s peak (the profiler's, of one segment's pass) inside the
    span a `PeakMemory` meters (a calibration run's), which keeps the peak so far. False where a
    CPU's mark cannot be reset."""
    before = device_peak(device)
    if before is not None:
        _carried[device.type] = max(_carried.get(device.type, 0), before)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    return _reset_high_water()


def _peak_so_far(device: torch.device) -> int | None:
    mark = device_peak(device)
    return None if mark is None else max(mark, _carried.get(device.type, 0))


class PeakMemory:
    """Started when the stage is built; `peak_bytes()` is the most the worker has held since,
    in the planner's terms: on a GPU its tensors, the stage's weights included; on a CPU the
    whole process. 0 where nothing can be measured."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._base: int | None = None
        self._mark: int | None = None
        _carried.pop(self.device.type, None)   # a new span: what was held before it is not its peak
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        if self.device.type != "cpu":
            return
        if not _reset_high_water():
            # the mark still holds the build's peak: only how far it rises from here counts, on
            # top of the resident size now, an under-estimate rather than the build
            log.info("cannot reset the resident high-water mark here: the measured peak leaves out "
                     "what the process held below the build's peak")
        self._base = resident_bytes()
        self._mark = resident_bytes("VmHWM")

    def growth_bytes(self) -> int:
        """How far the peak rose above what was held when the meter started (on a CPU the whole
        process then, the built model among it; on a GPU nothing is subtracted)."""
        return max(0, self.peak_bytes() - (self._base or 0))

    def out_of_memory(self, stage: int, stages: int, exc: BaseException) -> StageOutOfMemoryError:
        return StageOutOfMemoryError(stage, stages, self.device, self.peak_bytes(), str(exc))

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(_peak_so_far(self.device))
        hwm = _peak_so_far(self.device) if self._base is not None and self._mark is not None else None
        if hwm is None:
            return 0
        # the whole process, as the estimate counts it on a CPU (module docstring)
        return self._base + max(0, hwm - self._mark)
