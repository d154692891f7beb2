"""Checkpoints: what a Varuna checkpoint holds per layer (contents) and how its files are kept:
writing, committing, copying and pruning (store), naming, listing, verifying and reading (reading),
the plan-epoch fences against an old incarnation's late writes (fences), and the storage backends
under them (storage). Imports go one way: storage <- fences <- reading <- store <- contents.
Beside them: what a checkpoint records of the user's model (model_record: its state_dict names,
a Hugging Face config) and the export of a checkpoint as the user's own model files (export,
safetensors), which reads through reading and store.

May import: trainer.errors, torch, safetensors (export only), the standard library. Never the
engine or varunad.
"""
