"""Checkpoints: what a Varuna checkpoint holds per layer (contents) and how its files are written,
verified, found and pruned (store).

May import: trainer.errors, torch, the standard library. Never the engine or varunad.
"""
