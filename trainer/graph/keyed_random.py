"""The captured graph's random ops, keyed by the sample they act on (trainer.graph.keyed_rng,
[Note: randomness belongs to the sample]).

`key_random_ops` replaces every random op of a captured graph (dropout in all its forms,
bernoulli, rand/randn and their `_like` forms, uniform_/normal_, and scaled-dot-product
attention with a dropout probability) by a function of this module that draws from the
counter-based generator. Each gets its position among the graph's random ops as its op id:
the whole model is captured once, the same way by every worker, so the id is the same
whatever the stage cut. The key's other parts come from the `Draws` in force when the op runs
(the engine sets one per micro-batch forward and recompute; `keyed_randomness` in a plain loop).

Which examples an op's output holds is read from the captured shapes: the first dimension
whose size involves the batch's symbolic size is the batch dimension, with a fixed number of
rows per example (1 for (B, T, C); T for (B*T, C), read from the micro-batch's example count
in `Draws` where T varies from batch to batch). An op whose output has no such dimension
(`torch.rand(t, t)`) is keyed by the op alone: every micro-batch gets the same draw.

A random op not listed here (randint, multinomial, exponential_, ...) still draws from torch's
generator: the capture logs it, since it makes the model depend on the layout again.
"""

from __future__ import annotations

import logging
import math

import sympy
import torch
import torch.nn.functional as F
from torch import fx

from trainer.graph.keyed_rng import UNKEYED, current_draws, keyed_keep, keyed_normal, keyed_uniform

__all__ = ["key_random_ops", "draws", "draws_in_evaluation", "draws_unkeyed", "RANDOM_OPS"]

log = logging.getLogger("varuna")

_ALPHA = 1.7580993408473766   # SELU's alpha, as torch's alpha_dropout uses it


def _site(key_dim: int) -> int | None:
    return None if key_dim < 0 else key_dim


# key_rows: k > 0, k rows per example, an example's rows together (B*T, C from (B, T, C)); 0, as
# many rows per example as the dimension over the micro-batch's examples (T symbolic); INTERLEAVED,
# the examples repeat along it (T*B, C from (T, B, C); a batch concatenated with itself).
INTERLEAVED = -1


def _rows(shape, key_dim: int, key_rows: int) -> tuple[int, int | None]:
    """(rows per example, the micro-batch's examples where they are interleaved, else None)."""
    if key_rows > 0 or key_dim < 0:
        return max(key_rows, 1), None
    draws = current_draws()
    if draws is UNKEYED:   # outside any key (a calibration's forward): no draw is reproduced
        return 1, None
    examples, size = draws.examples, int(shape[key_dim])
    if examples is None or size % examples:
        raise ValueError(
            f"a random op draws for a flattened batch of {size} rows whose rows per example vary with the "
            "batch's sizes: enter keyed_randomness(..., examples=N) with the micro-batch's number of examples"
            if examples is None else f"a random op draws {size} rows for {examples} examples, not a multiple")
    return size // examples, examples if key_rows == INTERLEAVED else None


def _laid_out(draw: torch.Tensor, key_dim: int, interleaved: int | None) -> torch.Tensor:
    """`draw`, made with each example's rows together, in the op's layout: for examples that
    repeat along the dimension, row j*B + e holds example e's j-th row."""
    if interleaved is None:
        return draw
    rows = draw.shape[key_dim] // interleaved
    return draw.unflatten(key_dim, (interleaved, rows)).transpose(key_dim, key_dim + 1).flatten(key_dim, key_dim + 1)


def _keep(shape, p: float, like: torch.Tensor, key_op: int, key_dim: int, key_rows: int) -> torch.Tensor:
    rows, interleaved = _rows(shape, key_dim, key_rows)
    return _laid_out(keyed_keep(key_op, shape, p, batch_dim=_site(key_dim), rows_per_example=rows,
                                device=like.device), key_dim, interleaved)


def _uniform(shape, dtype, device, key_op: int, key_dim: int, key_rows: int) -> torch.Tensor:
    rows, interleaved = _rows(shape, key_dim, key_rows)
    return _laid_out(keyed_uniform(key_op, shape, batch_dim=_site(key_dim), rows_per_example=rows, dtype=dtype,
                                   device=device), key_dim, interleaved)


def _normal(shape, dtype, device, key_op: int, key_dim: int, key_rows: int) -> torch.Tensor:
    rows, interleaved = _rows(shape, key_dim, key_rows)
    return _laid_out(keyed_normal(key_op, shape, batch_dim=_site(key_dim), rows_per_example=rows, dtype=dtype,
                                  device=device), key_dim, interleaved)


def _drops(train) -> bool:
    return train is not False and current_draws().training


def _noise_shape(input: torch.Tensor, feature: bool) -> tuple[int, ...]:
    # Feature dropout drops whole channels: one draw per (example, channel).
    shape = tuple(input.shape)
    return shape[:2] + (1,) * (len(shape) - 2) if feature else shape


def _dropout(input, p, train, feature: bool, alpha: bool, key_op, key_dim, key_rows):
    if not _drops(train) or p == 0:
        return input   # as torch's dropout outside training: the input itself
    if p == 1:
        return input * input.new_zeros(())
    keep = _keep(_noise_shape(input, feature), p, input, key_op, key_dim, key_rows)
    if not alpha:
        # multiplying by the bool mask makes autograd keep the mask (one byte an element), as
        # torch's own dropout does
        return torch.mul(input, keep).mul_(1.0 / (1.0 - p))
    a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
    noise = keep.to(input.dtype)
    b = noise.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
    return input * noise.mul_(a) + b


def dropout(input, p, train, *, key_op, key_dim, key_rows):
    return _dropout(input, p, train, False, False, key_op, key_dim, key_rows)


def feature_dropout(input, p, train, *, key_op, key_dim, key_rows):
    return _dropout(input, p, train, True, False, key_op, key_dim, key_rows)


def alpha_dropout(input, p, train, *, key_op, key_dim, key_rows):
    return _dropout(input, p, train, False, True, key_op, key_dim, key_rows)


def feature_alpha_dropout(input, p, train, *, key_op, key_dim, key_rows):
    return _dropout(input, p, train, True, True, key_op, key_dim, key_rows)


def _in_place(fn):
    def mutate(self, p, train, *, key_op, key_dim, key_rows):
        return self.copy_(fn(self, p, train, key_op=key_op, key_dim=key_dim, key_rows=key_rows))
    mutate.__name__ = mutate.__qualname__ = fn.__name__ + "_"
    return mutate


def native_dropout(input, p, train=None, *, key_op, key_dim, key_rows):
    if not _drops(train) or p == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = _keep(input.shape, p, input, key_op, key_dim, key_rows)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return torch.mul(input, keep).mul_(scale), keep


def bernoulli(self, p=None, *, generator=None, key_op, key_dim, key_rows):
    prob = self if p is None else p
    u = _uniform(self.shape, torch.float64 if self.dtype == torch.float64 else torch.float32, self.device,
                 key_op, key_dim, key_rows)
    return (u < prob).to(self.dtype)


def bernoulli_(self, p=0.5, *, generator=None, key_op, key_dim, key_rows):
    return self.copy_(bernoulli(self, p, key_op=key_op, key_dim=key_dim, key_rows=key_rows))


def _factory(draw):
    def make(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
             key_op, key_dim, key_rows):
        return draw(tuple(size), dtype or torch.get_default_dtype(), device or "cpu", key_op, key_dim, key_rows)

    def make_like(self, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
                  memory_format=None, key_op, key_dim, key_rows):
        return draw(tuple(self.shape), dtype or self.dtype, device or self.device, key_op, key_dim, key_rows)
    return make, make_like


rand, rand_like = _factory(_uniform)
randn, randn_like = _factory(_normal)
for _f, _n in ((rand, "rand"), (rand_like, "rand_like"), (randn, "randn"), (randn_like, "randn_like")):
    _f.__name__ = _f.__qualname__ = _n


def uniform_(self, from_=0.0, to=1.0, *, generator=None, key_op, key_dim, key_rows):
    u = _uniform(self.shape, self.dtype, self.device, key_op, key_dim, key_rows)
    return self.copy_(u.mul_(to - from_).add_(from_))


def normal_(self, mean=0.0, std=1.0, *, generator=None, key_op, key_dim, key_rows):
    n = _normal(self.shape, self.dtype, self.device, key_op, key_dim, key_rows)
    return self.copy_(n.mul_(std).add_(mean))


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
              enable_gqa=False, key_op, key_dim, key_rows):
    """Scaled-dot-product attention whose dropout on the attention weights is keyed."""
    if not current_draws().training or dropout_p == 0:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and key.size(-3) != query.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    weights = (query @ key.transpose(-2, -1)).mul_(scale)
    L, S = query.size(-2), key.size(-2)
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        weights = weights.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        weights = weights.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else weights + attn_mask
    weights = torch.softmax(weights, dim=-1)
    weights = _dropout(weights, dropout_p, True, False, False, key_op, key_dim, key_rows)
    return weights @ value


_aten = torch.ops.aten
# Each random op the engine keys, and its replacement (same arguments, plus the key's site).
RANDOM_OPS = {
    _aten.dropout.default: dropout,
    _aten.dropout_.default: _in_place(dropout),
    _aten.feature_dropout.default: feature_dropout,
    _aten.feature_dropout_.default: _in_place(feature_dropout),
    _aten.alpha_dropout.default: alpha_dropout,
    _aten.alpha_dropout_.default: _in_place(alpha_dropout),
    _aten.feature_alpha_dropout.default: feature_alpha_dropout,
    _aten.feature_alpha_dropout_.default: _in_place(feature_alpha_dropout),
    _aten.native_dropout.default: native_dropout,
    _aten.bernoulli.default: bernoulli,
    _aten.bernoulli.p: bernoulli,
    _aten.bernoulli.Tensor: bernoulli,
    _aten.bernoulli_.float: bernoulli_,
    _aten.bernoulli_.Tensor: bernoulli_,
    _aten.rand.default: rand,
    _aten.rand.generator: rand,
    _aten.rand_like.default: rand_like,
    _aten.rand_like.generator: rand_like,
    _aten.randn.default: randn,
    _aten.randn.generator: randn,
    _aten.randn_like.default: randn_like,
    _aten.randn_like.generator: randn_like,
    _aten.uniform_.default: uniform_,
    _aten.normal_.default: normal_,
    _aten.scaled_dot_product_attention.default: attention,
}
_KEYED = frozenset(RANDOM_OPS.values())
# the ones that read the executor's training flag: dropout is the identity in an evaluation
_OFF_IN_EVALUATION = frozenset(fn for op, fn in RANDOM_OPS.items()
                               if "dropout" in op.name() or op is _aten.scaled_dot_product_attention.default)


def draws_in_evaluation(gm: fx.GraphModule) -> list[str]:
    """The keyed ops of `gm` that draw in an evaluation as in training: the capture is of the
    training forward, so a random op a model runs only under `if self.training` (drop-path,
    added noise) is in the graph unconditionally, and only dropout knows it is evaluating."""
    graph = getattr(gm, "graph", None)
    if not isinstance(graph, fx.Graph):
        return []
    return sorted({n.target.__name__ for n in graph.nodes if n.op == "call_function"
                   and n.target in _KEYED and n.target not in _OFF_IN_EVALUATION})


def _is_random(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target is _aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return torch.Tag.nondeterministic_seeded in node.target.tags


def draws(node: fx.Node) -> bool:
    """Whether `node` draws at random: a random op, or the keyed op that replaced one."""
    return _is_random(node) or (node.op == "call_function" and node.target in _KEYED)


def _batch_symbols(graph: fx.Graph) -> set:
    symbols = set()
    for node in graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[0], torch.SymInt):
            symbols |= val.shape[0].node.expr.free_symbols
    return symbols


def _drawn_shape(node: fx.Node):
    """The captured (symbolic) shape of what the op draws for: its output, or for attention
    the weights, which share the query's leading dimensions."""
    val = node.meta.get("val")
    if node.target is _aten.scaled_dot_product_attention.default:
        val = node.args[0].meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[0]
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _batch_layout(shape, batch: set) -> tuple[int, int] | None:
    """(dimension, rows per example) of the batch in `shape`, or None when no dimension is a
    whole multiple of the batch size. Rows per example 0: a multiple that is itself symbolic
    (B*T, T the batch's sequence length), which the op reads from the micro-batch's examples."""
    if shape is None:
        return None
    for d, size in enumerate(shape):
        if not isinstance(size, torch.SymInt):
            continue
        expr = size.node.expr
        for sym in expr.free_symbols & batch:
            ratio = expr / sym
            if ratio.is_Integer and int(ratio) > 0:
                return d, int(ratio)
            if ratio.free_symbols and not ratio.free_symbols & batch and ratio.is_integer and ratio.is_positive:
                return d, 0
    return None


_RESHAPES = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _same(a, b) -> bool:
    return sympy.simplify(a - b) == 0


def _merged(before, after, d: int) -> tuple[int, int] | None:
    """The dimensions [i, j) of shape `before` that a reshape to `after` merges into its dimension
    `d`, or None where they do not line up."""
    prefix, i, acc = sympy.Integer(1), 0, sympy.Integer(1)
    for size in after[:d]:
        prefix *= _expr(size)
    while i < len(before) and not _same(acc, prefix):
        acc *= _expr(before[i])
        i += 1
    want, j, acc = _expr(after[d]), i, sympy.Integer(1)
    while j < len(before) and not _same(acc, want):
        acc *= _expr(before[j])
        j += 1
    return (i, j) if _same(acc, want) and j > i else None


def _examples_repeat(node: fx.Node, d: int, batch: set) -> bool:
    """Whether dimension `d` of what random op `node` draws for holds the examples repeated
    (row j*B + e is example e's) rather than each example's rows together: its input made by a
    reshape that merges a leading dimension into the batch's ((T, B, C) to (T*B, C)), by a
    concatenation along the batch, or by a repeat of it. Followed back through ops that keep
    the shape (copies, elementwise ops); anything else counts as rows together."""
    x = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    shape = _drawn_shape(node)
    for _ in range(16):
        if x is None or x.op != "call_function":
            return False
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or shape is None or len(val.shape) != len(shape):
            return False
        source = x.args[0] if x.args and isinstance(x.args[0], fx.Node) else None
        if x.target in _RESHAPES and source is not None and isinstance(source.meta.get("val"), torch.Tensor):
            before = tuple(source.meta["val"].shape)
            group = _merged(before, tuple(val.shape), d)
            at = next((k for k, size in enumerate(before)
                       if isinstance(size, torch.SymInt) and size.node.expr.free_symbols & batch), None)
            return group is not None and at is not None and group[0] <= at < group[1] and any(
                not _same(_expr(before[k]), 1) for k in range(group[0], at))
        if x.target is _aten.cat.default:
            dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
            return dim % len(shape) == d and len(x.args[0]) > 1
        if x.target is _aten.repeat.default:
            repeats = list(x.args[1])
            return not _same(_expr(repeats[len(repeats) - len(shape) + d]), 1)
        src = source.meta.get("val") if source is not None else None
        # compared as expressions: a SymInt comparison is a guard, and a sample whose batch size
        # equals another dimension (16 examples of 16 tokens) would then make the two one symbol
        # for every later op, or fix the batch size at 16
        if not isinstance(src, torch.Tensor) or len(src.shape) != len(val.shape) or not all(
                _same(_expr(a), _expr(b)) for a, b in zip(src.shape, val.shape)):
            return False
        x = source
    return False


def draws_unkeyed(gm: fx.GraphModule) -> bool:
    """Whether `gm` still holds a random op that draws from torch's generator (any module that
    is not a captured graph may)."""
    graph = getattr(gm, "graph", None)
    return not isinstance(graph, fx.Graph) or any(_is_random(n) for n in graph.nodes)


def key_random_ops(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Replace `gm`'s random ops by keyed ones, numbered in graph order; returns old -> new node."""
    graph = gm.graph
    batch = _batch_symbols(graph)
    replaced: dict[fx.Node, fx.Node] = {}
    unkeyed: set[str] = set()
    op_id = 0
    for node in list(graph.nodes):
        if not _is_random(node):
            continue
        fn = RANDOM_OPS.get(node.target)
        if fn is None:
            unkeyed.add(str(node.target))
            continue
        shape = _drawn_shape(node)
        layout = _batch_layout(shape, batch)
        if layout is None and shape is not None and any(
                isinstance(s, torch.SymInt) and s.node.expr.free_symbols & batch for s in shape):
            log.warning("random op %s draws a tensor whose shape %s depends on the batch size other than "
                        "as whole rows per example: it is keyed by the op alone, so its draws change with "
                        "the micro-batch size", node.target, tuple(shape))
        key_dim, key_rows = layout if layout is not None else (-1, 1)
        if layout is not None and _examples_repeat(node, key_dim, batch):
            key_rows = INTERLEAVED
        kwargs = {k: v for k, v in node.kwargs.items() if k != "generator"}
        if "from" in kwargs:   # a Python keyword: the replacement spells it from_
            kwargs["from_"] = kwargs.pop("from")
        kwargs.update(key_op=op_id, key_dim=key_dim, key_rows=key_rows)
        with graph.inserting_before(node):
            new = graph.call_function(fn, node.args, kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced[node] = new
        op_id += 1
    if unkeyed:
        log.warning("the model draws with %s, which the engine does not key by sample: their draws depend on "
                    "the P x D layout and the micro-batch size; use dropout, bernoulli, rand or randn "
                    "to get the same model at every layout", ", ".join(sorted(unkeyed)))
    if replaced:
        gm.recompile()
    return replaced
