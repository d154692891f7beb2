"""The profiler: measure a model once and write its scale-invariant `Calibration`.

    profiler = Profiler(model, get_batch_fn, out_folder="profiles")
    profiler.set_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))   # optional
    calibration = profiler.profile_all([1, 2, 4, 8])

What is measured (medians over `repeats` runs after `warmup` runs):

* per cut-point segment (the model sliced at *every* cut point, one module per segment) and per
  micro-batch size: the forward without autograd (`forward_s`, a FORWARD of a recomputing
  stage; on the last segment, which only the last stage runs and never recomputes, the forward
  with autograd), the forward with autograd (`recompute_s`: a RECOMPUTE, and the FORWARD of a
  stage that keeps its graph), and a real autograd backward given an upstream gradient of the output's
  shape (`backward_s`; on the last segment, the loss's backward as the executor does it), with
  several micro-batches in flight as a running pipeline interleaves them
  (`measure_segments_interleaved`: a backward after other micro-batches' forwards, as the
  executor runs it, not straight after its own). The
  input activation is the real boundary tensor of the previous segment on a sample batch;
  `activation_bytes` is the size of the segment's output boundary (its gradient has the same
  size); `peak_activation_bytes` is what autograd saves for one micro-batch (on CPU the distinct
  storages packed by `torch.autograd.graph.saved_tensors_hooks`, parameters excluded; on CUDA the
  rise of `max_memory_allocated` during that forward);
* per segment: parameter bytes (a weight shared by several segments, like a tied embedding, is
  counted in each: every stage using it holds a copy), optimizer-state bytes (measured after a
  step of the optimizer given to `set_optimizer`, otherwise `optimizer_factor` x the parameter
  bytes: 2 for Adam), and `step_s`: what the engine's STEP does for those parameters (its
  squared gradient norms, the finiteness check, then the optimizer's step, on copies so that
  the model is left untouched; on CPU scaled so that the segments' times add up to one STEP of
  all of them, which pays a call's fixed costs once);
* tied weights (one tensor used by several segments, like a tied embedding and LM head): the
  segments holding each and its bytes (`Calibration.tied`), for the all-reduce that keeps the
  copies equal at any D;
* the network, in two helper processes on loopback (so no launcher and no process group of the
  caller is needed): a `PeerChannel` ping-pong fitted to ``latency + bytes / bandwidth`` for
  the "intra" link, with the CPU time a send call takes and a receive of a message that has
  already arrived (`send_overhead_s`, `recv_overhead_s`: stage busy time, the medians over the
  sizes that fit one frame) taken out of the latency; and gloo `all_reduce` between the two,
  fitted to the ring formula of `LinkCost.allreduce_s` at D = 2 (larger rings follow from the
  formula). "inter" gets the same numbers unless `inter_link` / `inter_allreduce` give measured
  cross-host costs (this machine cannot measure a link it does not have).

On CPU the workers of one host share its cores' time, caches and memory bandwidth, so a slot of a
busy host is slower than a lone worker: `gpus_per_node=n` measures with n slots busy at once
(n forked processes doing the same measurements; each number is the slowest slot's, since the
cores of a VM are not equally fast and lock-step replicas or a pipeline's bottleneck wait for
the slowest) and names the device kind 'cpu-<n>slots'.

The result depends on neither P nor D. It is keyed by (model fingerprint, device kind): the
fingerprint hashes the parameter and buffer names, shapes and dtypes, the captured graph's op
sequence (with constant arguments), the cut points and the precision, never the
weights' values. It is saved as `<out_folder>/calibration-<fingerprint>-<device kind>.json`;
`from_cache=True` returns a saved calibration of the same key that covers the sizes asked for,
and `add_to_existing=True` measures only what a saved one lacks and merges the two.

CPU timings depend on the allocator: workers run with glibc's trimming and mmap thresholds
raised (`trainer.launch.worker_environment`), which removes thousands of page faults a step.
Profile in that environment too (the daemon's VARUNA_PROFILE run is a worker; a script can be
started with `python -m trainer.launch -P 1`); the profiler logs a warning otherwise.

The measurement functions (`measure_segments[_interleaved]`, `measure_network`,
`model_fingerprint`) work on their own, so a daemon's worker can call them without the rest.

The package, one module per job: `segments` (segment timing), `steps` (optimizer-step timing),
`slots` (a model's compute measurements, alone or in one forked process per busy slot),
`network` (loopback link and all-reduce costs, the affine fit), `identity` (fingerprint, device
kind, file name), `calibrate` (the Profiler: measure, merge with the saved calibration, write),
`calibration_run` (a worker's VARUNA_PROFILE run, hooked into the engine by the package root
`trainer`), and `common` (the error, small helpers and the fork harness).

May import: trainer.engine, trainer.launch, trainer.graph, trainer.planning, trainer.errors,
trainer.worker_env, protocol, torch. The engine never imports the profiler.
"""

from trainer.profiler.calibrate import Profiler
from trainer.profiler.common import ProfilerError
from trainer.profiler.identity import calibration_path, device_kind_of, model_fingerprint
from trainer.profiler.network import fit_affine, measure_network
from trainer.profiler.segments import (
    IN_FLIGHT,
    SegmentMeasurement,
    measure_segments,
    measure_segments_interleaved,
    segment_slices,
    tied_weights,
)
from trainer.profiler.steps import measure_steps

__all__ = [
    "ProfilerError",
    "Profiler",
    "SegmentMeasurement",
    "IN_FLIGHT",
    "model_fingerprint",
    "device_kind_of",
    "segment_slices",
    "measure_segments",
    "measure_segments_interleaved",
    "measure_steps",
    "measure_network",
    "fit_affine",
    "tied_weights",
    "calibration_path",
]
