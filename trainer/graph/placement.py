"""Where a captured graph's own tensors are made.

torch.export records the device the model was captured on in the graph itself: a factory op
(`arange(..., device=cpu)` for position ids, `full`, `zeros`), a `to(device)` and the metadata
checks keep that device as a constant. A stage captured on the CPU (or on the meta device) and
then moved to a GPU would make those tensors on the CPU and fail at its first op that mixes them
('Expected all tensors to be on the same device ... index is on cpu'). So moving a captured
module also moves those constants, in the subgraphs of higher-order ops too (an autocast region
around rotary embeddings). A user's own explicit `.to("cpu")` inside `forward` moves with them:
a stage runs on one device.
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["retarget_graph"]


def retarget_graph(gm: torch.nn.Module, source: torch.device, target: torch.device) -> int:
    """Make every device constant of type ``source.type`` in ``gm``'s graphs ``target``; returns
    how many were changed (0: nothing to recompile)."""
    source, target = torch.device(source), torch.device(target)
    if source == target:
        return 0
    changed = 0

    def swap(v):
        nonlocal changed
        if isinstance(v, torch.device) and v.type == source.type and v != target:
            changed += 1
            return target
        return v

    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            before = changed
            for node in module.graph.nodes:
                node.args = fx.node.map_aggregate(node.args, swap)
                node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
            if changed != before:
                module.recompile()
    return changed
