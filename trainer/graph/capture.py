"""Capturing a whole model as one graph of aten ops, with its potential cut points.

`capture_model` runs the user's forward once under `torch.export.export(strict=False)` on a
sample batch: Python runs as written (shape arithmetic, `torch.ones(t, t)`, Hugging Face's
config branches), and what comes out is the training IR that autograd differentiates. The
batch dimension is dynamic, so one capture serves every micro-batch size (ragged last ones
too). CutPoints (and, for a model without any, the outputs of the blocks of its largest
nn.Sequential/nn.ModuleList) become `varuna::cut` marker nodes, and random ops become keyed
ones (trainer.graph.keyed_random), whose draws do not depend on where they run. Forward returns
the loss, or a dict / Hugging Face `ModelOutput` holding one under "loss" (a model given its
labels, unwrapped), whose other outputs are dropped; a forward with a `use_cache` argument is
captured with it False, since training never reads a key-value cache.

The exported program lifts parameters, buffers and constants into inputs; here they become
`get_attr` nodes again, placed at their first use and named by their path in the user's model,
holding the user's own tensor objects. A buffer the forward updates (BatchNorm's running
statistics) gets a `copy_` node writing the new value back, so training mutates the module's
buffers as eager mode does.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from trainer.errors import ConfigError, PartitionError
from trainer.graph import capture_cache
from trainer.graph.cutpoint import CutPoint, capturing, cut_marker, is_marker, marker_name
from trainer.graph.forward_effects import watching_forward
from trainer.graph.host_random import innermost_user_frame, watching_host_random
from trainer.graph.keyed_random import key_random_ops
from trainer.graph.written import batch_statistics, region_writes

__all__ = ["TracedModel", "capture_model", "auto_blocks"]

log = logging.getLogger("varuna")


@dataclass(frozen=True)
class TracedModel:
    """The whole model as one graph, with its potential cut points in execution order."""

    graph_module: fx.GraphModule
    markers: tuple[fx.Node, ...]
    canonical: dict[int, str]          # id(parameter or buffer) -> its name in the user's model
    input_names: tuple[str, ...]
    auto: bool                          # cut points were inferred from a block container
    mutations: tuple[fx.Node, ...] = ()   # copy_ nodes updating buffers (BatchNorm statistics)
    reused: bool = False   # loaded from a capture cache, not exported

    @property
    def marker_names(self) -> list[str]:
        return [marker_name(m) for m in self.markers]


def auto_blocks(model: nn.Module) -> tuple[str, ...]:
    """The blocks after which a model without CutPoints may be cut: all but the last child of the
    nn.Sequential/nn.ModuleList that spreads the most parameters over its children.

    A container is scored by the parameters outside its largest child, so a transformer's list of
    blocks wins over the four-long Sequential inside each block's MLP (by length alone it would lose),
    and over an outer (body, head) pair, which has one cut to offer and keeps nearly all the weights
    on one side of it. Ties go to the longer container (more cuts), then the earlier one."""
    best, best_key = None, (0, 1)
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Sequential, nn.ModuleList)) and len(mod) >= 2:
            sizes = [sum(p.numel() for p in child.parameters()) for child in mod]
            key = (sum(sizes) - max(sizes), len(mod))
            if key > best_key:
                best, best_key = name, key
    if best is None:
        return ()
    container = model.get_submodule(best)
    prefix = f"{best}." if best else ""
    return tuple(f"{prefix}{i}" for i in range(len(container) - 1))


def _mark_block_output(name: str):
    def hook(module, args, output):
        marker = f"{name}:out"
        if isinstance(output, torch.Tensor):
            return cut_marker(output, marker)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            # Hugging Face blocks return (hidden_states, *extras): the hidden states cross
            return (cut_marker(output[0], marker), *output[1:])
        raise PartitionError(
            f"block '{name}' returns {type(output).__name__}, not a tensor (or a tuple starting with one)",
            hint="add CutPoint()s to the model where one tensor carries everything the next layers need")
    return hook


def _forward_inputs(model: nn.Module, sample: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """The sample's tensors that forward takes, by name; a batch of one is doubled so that the
    batch dimension can be captured as dynamic (export fixes sizes 0 and 1)."""
    params = inspect.signature(model.forward).parameters
    wanted = {k: v for k, v in sample.items() if isinstance(v, torch.Tensor) and k in params}
    # Keys forward does not name (an example's id beside a Hugging Face model's inputs) stay out,
    # as step() leaves them out: through a `**kwargs` they would reach code that does not expect
    # them, and torch.export cannot give them a dynamic batch dimension.
    unnamed = sorted(k for k in sample if k not in params)
    if unnamed:
        # a warning: a misspelt key ("label") is left out this way too
        log.warning("capture: the batch's %s %s not named by %s.forward: left out", ", ".join(unnamed),
                    "is" if len(unnamed) == 1 else "are", type(model).__name__)
    missing = [n for n, p in params.items()
               if p.default is inspect.Parameter.empty and n not in wanted
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if missing:
        raise ConfigError(f"the batch has no {missing}, which {type(model).__name__}.forward needs",
                          hint=f"get_batch_fn must return a dict with keys {list(params)}")
    if not wanted and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ConfigError(f"{type(model).__name__}.forward takes the batch only through **kwargs",
                          hint=f"name the inputs as forward's arguments ({', '.join(unnamed)}): the capture "
                               "gives each of them a dynamic batch dimension by name")
    if not wanted or any(v.dim() == 0 for v in wanted.values()):
        raise ConfigError("get_batch_fn must return batch-first tensors",
                          hint=f"got {({k: tuple(v.shape) for k, v in wanted.items()})}")
    if next(iter(wanted.values())).shape[0] == 1:
        wanted = {k: torch.cat([v, v]) for k, v in wanted.items()}
    return wanted


def _user_frame(exc: BaseException) -> str:
    """file:line and code of the innermost frame of the user's code in the traceback."""
    return innermost_user_frame(traceback.extract_tb(exc.__traceback__))


def _why(exc: BaseException) -> tuple[str, str]:
    """(what went wrong, what to change in the model), one line each."""
    where = _user_frame(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    data_dependent = "data-dependent" in str(exc) or type(exc).__name__ in (
        "GuardOnDataDependentSymNode", "PendingUnbackedSymbolNotFound")
    if data_dependent and "layerdrop" in where.lower():
        # transformers' LayerDrop (BART, OPT, Wav2Vec2...): a draw decides in Python which layers run
        return (f"Python control flow depends on a tensor's value at {where}: LayerDrop skips layers at random "
                "per step",
                "set the model's LayerDrop to 0 in its config (layerdrop, encoder_layerdrop, decoder_layerdrop) "
                "before building it; dropout inside the layers is kept by sample and needs no change")
    if data_dependent:
        return (f"Python control flow depends on a tensor's value at {where or 'an unknown place'}",
                "compute both branches and pick with torch.where (or use torch.cond), or move the "
                "decision out of forward; `if`/`bool()`/`.item()` on tensors cannot be captured")
    if "generator" in where:
        return (f"{type(exc).__name__}: {text[:300]} at {where}",
                "draw without generator=: Varuna keys torch's random ops by (seed, step, example), the "
                "same in every worker and every P x D, so a generator of the model's own is not needed")
    return (f"{type(exc).__name__}: {text[:300]}" + (f" at {where}" if where else ""),
            "make forward run on a batch of any size with the batch's tensors as its only "
            "inputs, and return the loss")


def _fixed_arguments(model: nn.Module, sample: Mapping[str, object]) -> dict[str, object]:
    """Arguments passed as constants while capturing: a Hugging Face model given to Varuna as it
    is would return its key-value cache beside the loss (`use_cache`, on by default for causal
    LMs), which training never reads and export cannot flatten. Only a model whose config has a
    `use_cache` (transformers' models) is told so, and a value the batch gives wins."""
    if "use_cache" not in inspect.signature(model.forward).parameters:
        return {}
    given = sample.get("use_cache")
    if given is not None and not isinstance(given, torch.Tensor):
        return {"use_cache": given}
    if given is None and getattr(getattr(model, "config", None), "use_cache", None) is not None:
        return {"use_cache": False}
    return {}


def _loss_output(ep, results: list) -> list:
    """The loss alone of a forward that returns a Hugging Face `ModelOutput` (or a dict) holding
    one under "loss", beside the logits and what else the model returns: the model trains as it
    is, unwrapped. Any other output is returned as it was."""
    spec = ep.call_spec.out_spec
    keys = spec.context if isinstance(spec.context, (list, tuple)) else None
    if len(results) < 2 or not keys or "loss" not in keys or len(keys) != spec.num_children:
        return results
    children = spec.children()
    at = keys.index("loss")
    if children[at].num_leaves != 1:
        return results
    return [results[sum(child.num_leaves for child in children[:at])]]


def capture_model(model: nn.Module, sample: Mapping[str, object], *,
                  cache_dir: str | os.PathLike[str] | None = None) -> TracedModel:
    """Capture `model`'s forward on `sample` (one batch from get_batch_fn) as one graph. With
    `cache_dir`, an exported program kept there for the same model, sample and libraries is
    loaded instead of exporting again, and a new export is kept there (trainer.graph.capture_cache)."""
    for name, m in model.named_modules():
        if isinstance(m, CutPoint):
            m._varuna_name = name
    has_cutpoints = any(isinstance(m, CutPoint) for m in model.modules())
    blocks = () if has_cutpoints else auto_blocks(model)
    inputs = _forward_inputs(model, sample)
    fixed = _fixed_arguments(model, sample)
    key = None if cache_dir is None else capture_cache.cache_key(model, inputs, fixed)
    kept = None if key is None else capture_cache.load(cache_dir, key)
    built = None
    if kept is not None:
        try:
            built = _graph_of(model, kept, from_model=True)
        except Exception as exc:   # whatever a kept program does wrong, a fresh export is the answer
            log.warning("capture: the cached program does not fit this model (%s: %s); exporting it again",
                        type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            capture_cache.forget(cache_dir, key)
    reused = built is not None
    if built is None:
        ep = _export(model, inputs, fixed, blocks)
        built = _graph_of(model, ep, from_model=False)
        if key is not None:   # kept only once it made a graph this package accepts
            capture_cache.save(cache_dir, key, ep, model)
    gm, input_names, mutations, markers = built
    canonical: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        canonical.setdefault(id(t), name)
    return TracedModel(gm, markers, canonical, input_names, bool(blocks), mutations, reused)


def _graph_of(model: nn.Module, ep, *, from_model: bool):
    """(graph module, input names, buffer mutations, cut markers) of an exported program, checked."""
    gm, input_names, mutations = _to_graph_module(model, ep, from_model=from_model)
    # Random ops draw by (seed, step, example, op) from here on, so every layout draws alike.
    keyed = key_random_ops(gm)
    mutations = tuple(keyed.get(n, n) for n in mutations)
    markers = tuple(n for n in gm.graph.nodes if is_marker(n))
    _warn_of_hidden_markers(gm)
    _warn_of_batch_statistics(gm)
    _check_batch_is_dynamic(gm)
    return gm, input_names, mutations, markers


def _warn_of_batch_statistics(gm: fx.GraphModule) -> None:
    """Say so when the model normalises with the statistics of the batch it is given (BatchNorm in
    training): each micro-batch is normalised on its own, so the trained model depends on the
    micro-batch size, which the planner picks, unlike everything else a plan changes."""
    norms = batch_statistics(gm)
    if norms:
        log.warning("capture: %d BatchNorm layer(s) normalise each micro-batch with its own statistics: the "
                    "model trained depends on the micro-batch size (as with gradient accumulation). Under varunad "
                    "the job keeps the script's chunk_size unless submitted with --chunk-size N; or use GroupNorm "
                    "or LayerNorm", norms)


def _warn_of_hidden_markers(gm: fx.GraphModule) -> None:
    """Say so when cut points sit inside a region torch.export keeps as one op (a forward under
    `torch.autocast` becomes one `wrap_with_autocast`): the model cannot be cut there, and the
    error a pipeline then meets ("the model has 0 cut points") would not say why."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        inner = [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
        hidden = sum(is_marker(n) for a in inner if isinstance(sub := getattr(gm, a.target, None), fx.GraphModule)
                     for n in sub.graph.nodes)
        if hidden:
            log.warning("capture: %d cut point(s) lie inside %s, which torch.export keeps as one op: the model "
                        "cannot be split there, so it runs as a single pipeline stage. %s", hidden, node.target,
                        "Take torch.autocast out of forward and pass precision='bf16' (or 'fp16') to Varuna, "
                        "which autocasts every stage." if "autocast" in str(node.target) else
                        "Move the cut points out of that region.")


def _dynamic(inputs: Mapping[str, torch.Tensor], fixed: Mapping[str, object], *, every_dim: bool):
    """export's dynamic_shapes: the batch dimension, and with ``every_dim`` every other one too
    (AUTO: a size the model's code needs fixed, a Linear's features, is fixed and the rest stay
    symbolic), so batches padded to their own longest sequence run on one capture. An input of 4
    or more dimensions (images, video) keeps its other sizes: symbolic heights and widths tripled
    a ResNet's capture time for sizes a dataset seldom varies."""
    dims = {k: {d: torch.export.Dim.AUTO for d in range(v.dim() if every_dim and v.dim() < 4 else 1)}
            for k, v in inputs.items()}
    return {**dims, **dict.fromkeys(fixed)}


def _export(model: nn.Module, inputs, fixed, blocks):
    hooks = [model.get_submodule(b).register_forward_hook(_mark_block_output(b)) for b in blocks]
    host: list[str] = []
    effects: list[str] = []
    try:
        with capturing(), watching_host_random(host), watching_forward(model, effects), _quiet_failed_export():
            try:
                ep = torch.export.export(model, (), {**inputs, **fixed},
                                         dynamic_shapes=_dynamic(inputs, fixed, every_dim=True), strict=False)
            except (PartitionError, ConfigError):
                raise
            except Exception as exc:   # some code only captures with its sizes fixed: the batch's alone then
                log.info("capture: with every dimension symbolic export failed (%s: %s); capturing with the "
                         "batch dimension alone symbolic, so every batch must have the sample's other sizes",
                         type(exc).__name__, str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "")
                ep = torch.export.export(model, (), {**inputs, **fixed},
                                         dynamic_shapes=_dynamic(inputs, fixed, every_dim=False), strict=False)
        _warn_of_host_random(host)
        for effect in dict.fromkeys(effects):
            log.warning("capture: %s", effect)
        return ep
    except (PartitionError, ConfigError):
        raise
    except Exception as exc:  # export raises many kinds for Python it cannot capture
        what, change = _why(exc)
        raise PartitionError(
            f"cannot capture {type(model).__name__}:\n"
            f"  tried torch.export.export(strict=False) with a dynamic batch dimension: {what}\n"
            f"  change in the model: {change}\n"
            f"  (torch.fx symbolic tracing is not tried: it refuses everything export refuses, and more)") from exc
    finally:
        for h in hooks:
            h.remove()


_EXPORT_TRACE = os.path.join("torch", "export", "_trace.py")


class _WithoutExportGraphs:
    """stderr itself, each write passed on at once, less what torch's export prints itself
    (`print(e.partial_fx_graph, file=sys.stderr)` when a capture fails): told by the Python frame
    that wrote it. Anything else (fileno, buffer, isatty) is the real stream's."""

    def __init__(self, real) -> None:
        self._real = real

    def write(self, text: str) -> int:
        if sys._getframe(1).f_code.co_filename.endswith(_EXPORT_TRACE):
            return len(text)
        return self._real.write(text)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


@contextlib.contextmanager
def _quiet_failed_export():
    """A capture that meets control flow on a tensor's value has torch's shape solver log a warning
    and export print the partial graph to stderr (300 lines for a 2-layer OPT), before the refusal
    that says where and what to change: both kept out of the user's output (the warning unless
    the user asked torch for its logs, TORCH_LOGS)."""
    solver = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = solver.level
    if solver.getEffectiveLevel() >= logging.WARNING:
        solver.setLevel(logging.ERROR)
    real = sys.stderr
    sys.stderr = _WithoutExportGraphs(real)
    try:
        yield
    finally:
        if isinstance(sys.stderr, _WithoutExportGraphs):   # what forward set in its place stays
            sys.stderr = real
        solver.setLevel(level)


def _warn_of_host_random(calls: list[str]) -> None:
    """Say where forward drew from a generator the capture cannot key (trainer.graph.host_random)."""
    for call in dict.fromkeys(calls):
        if call.startswith("torch.manual_seed"):
            log.warning("capture: forward calls %s: it has no effect on the captured model, whose random ops "
                        "draw by (seed, step, example, op); Varuna(seed=...) sets the seed", call)
        else:
            log.warning("capture: forward calls %s: the capture runs forward once, so this draw is fixed into "
                        "the model for every step, and differs from worker to worker unless seeded (replicas "
                        "then train different models, and fail in a collective). Draw with torch instead, which "
                        "Varuna keys by example (to drop a layer: keep = torch.rand(x.shape[0], 1, 1) >= p, "
                        "then torch.where(keep, layer(x), x))", call)


def _check_batch_is_dynamic(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() and is_concrete_int(val.shape[0]):
            raise PartitionError(
                f"the model fixes the batch dimension of '{node.target}' at {val.shape[0]}: the capture "
                "would only run micro-batches of that size",
                hint="derive sizes from the input (x.size(0), reshape(-1, ...)) instead of constants")


def _to_graph_module(model: nn.Module, ep, *, from_model: bool = False):
    """The exported program as a GraphModule whose parameters and buffers are get_attr nodes
    (at their first use) of the user's own tensors, named by their path in the model. A fresh
    export holds the model's tensors; a loaded one (`from_model`) holds tensors without storage,
    and the model's are looked up by name."""
    from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind

    sig = ep.graph_signature
    order = list(ep.call_spec.in_spec.child(1).context)   # kwargs, as flattened
    ph = [n for n in ep.graph.nodes if n.op == "placeholder"]
    attrs: dict[fx.Node, tuple[str, torch.Tensor]] = {}
    users: dict[fx.Node, str] = {}
    user_specs = iter(order)
    constants: dict[fx.Node, object] = {}
    for node, spec in zip(ph, sig.input_specs):
        if spec.kind is InputKind.USER_INPUT:
            name = next(user_specs)
            if isinstance(spec.arg, ConstantArgument):   # `_fixed_arguments`: a value, not an input
                constants[node] = spec.arg.value
            else:
                users[node] = name
        elif spec.kind is InputKind.PARAMETER or (spec.kind is InputKind.BUFFER and spec.persistent):
            attrs[node] = (spec.target, _owned(model, spec.target) if from_model else ep.state_dict[spec.target])
        elif spec.kind is InputKind.BUFFER:
            attrs[node] = (spec.target, _owned(model, spec.target) if from_model else ep.constants[spec.target])
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            attrs[node] = (spec.target, ep.constants[spec.target])
        else:
            raise PartitionError(f"the captured graph has an input of kind {spec.kind.name} ('{spec.target}')",
                                 hint="forward must take the batch's tensors and use ordinary parameters" + (
                                     "; a torch.Generator the model holds is such an object: draw without "
                                     "generator=, Varuna keys torch's random ops by (seed, step, example)"
                                     if spec.kind is InputKind.CUSTOM_OBJ else ""))
    root = nn.Module()
    for target, t in attrs.values():
        _register(root, target, t)
    for node in ep.graph.nodes:   # subgraphs of higher-order ops (autocast regions, ...)
        if node.op == "get_attr":
            obj = ep.graph_module
            for part in node.target.split("."):
                obj = getattr(obj, part)
            _register(root, node.target, obj)

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node, name in users.items():
        env[node] = graph.placeholder(name)
        env[node].meta = dict(node.meta)

    def value(n: fx.Node) -> fx.Node:
        if n in constants:
            return constants[n]
        if n not in env:   # a parameter, buffer or constant: read where it is first used
            env[n] = graph.get_attr(attrs[n][0])
            env[n].meta = dict(n.meta)
        return env[n]

    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    for node in ep.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        env[node] = graph.node_copy(node, value)
    outs = list(out_node.args[0])
    results, written = [], []
    for spec, out in zip(sig.output_specs, outs):
        if spec.kind is OutputKind.BUFFER_MUTATION:
            written.append((spec.target, out))
        elif spec.kind is OutputKind.USER_OUTPUT:
            results.append(out)
        else:
            raise PartitionError(f"forward {'modifies its input ' + repr(spec.target) if spec.target else 'has an output'}"
                                 f" of kind {spec.kind.name}",
                                 hint="forward must return the loss and leave its inputs unchanged")
    results = _loss_output(ep, results)
    if len(results) != 1 or not isinstance(results[0], fx.Node) \
            or not isinstance(results[0].meta.get("val"), torch.Tensor) or results[0].meta["val"].dim() != 0:
        raise PartitionError(f"{type(model).__name__}.forward must return the loss as a single scalar tensor",
                             hint="wrap the model in a module whose forward returns only the loss, or return a "
                                  "dict or ModelOutput with a 'loss' (a Hugging Face model does when the batch "
                                  "holds its labels)")
    graph.output(value(results[0]))
    mutations = [_write_back(graph, target, value(out)) for target, out in written]
    # In-place updates nothing reads afterwards (BatchNorm's num_batches_tracked += 1): a slice
    # from the loss would drop them.
    mutations += [n for n in graph.nodes if n.op == "call_function" and not n.users
                  and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
                  and n not in mutations]
    gm = fx.GraphModule(root, graph, class_name=f"Captured{type(model).__name__}")
    # ... and those made in a region export keeps as one op (an EMA updated under torch.no_grad())
    mutations += [n for n in gm.graph.nodes if not n.users and n not in mutations and region_writes(n)]
    return gm, tuple(users.values()), tuple(mutations)


def _owned(model: nn.Module, target: str) -> torch.Tensor:
    """The model's parameter or buffer called `target` (a cached program names it so)."""
    owner, _, name = target.rpartition(".")
    try:
        t = getattr(model.get_submodule(owner) if owner else model, name)
    except AttributeError:
        t = None
    if not isinstance(t, torch.Tensor):
        raise PartitionError(f"the cached capture reads '{target}', which the model does not have",
                             hint="a bug in the capture cache's key: delete the cache directory")
    return t


def _write_back(graph: fx.Graph, target: str, new: fx.Node) -> fx.Node:
    """A copy_ of a buffer's new value into the buffer, placed after its value and after every
    read of the old one, so it belongs to the segment that computes it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    reads = [u for n in graph.nodes if n.op == "get_attr" and n.target == target for u in n.users]
    anchor = max([new, *reads], key=order.__getitem__)
    with graph.inserting_after(anchor):
        buf = graph.get_attr(target)
    with graph.inserting_after(buf):
        return graph.call_function(torch.ops.aten.copy_.default, (buf, new))


def _register(root: nn.Module, target: str, obj) -> None:
    *path, leaf = target.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if hasattr(mod, leaf):
        return
    if isinstance(obj, nn.Parameter):
        mod.register_parameter(leaf, obj)
    elif isinstance(obj, torch.Tensor):
        mod.register_buffer(leaf, obj)
    elif isinstance(obj, nn.Module):
        mod.add_module(leaf, obj)
    else:
        setattr(mod, leaf, obj)
