"""Checkpoints: what a Varuna checkpoint holds per layer (contents) and how its files are kept:
writing, committing, copying and pruning (store), naming, listing, verifying and reading (reading),
the plan-epoch fences against an old incarnation's late writes (fences), and the storage backends
under them (storage). Imports go one way: storage <- fences <- reading <- store <- contents.

May import: trainer.errors, torch, the standard library. Never the engine or varunad.
"""
