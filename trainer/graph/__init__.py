"""The model as a graph: cut points and their marker op, capturing a whole model as one aten graph,
slicing it into per-stage modules, and the layout of which stage owns which tensor.

May import: trainer.errors, torch. Nothing of the engine or of varunad.
"""
