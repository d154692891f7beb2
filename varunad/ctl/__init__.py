"""varunactl: the command line (cli: the parser; handlers: what each subcommand runs), the fleet
commands it runs through etcd (commands), the local ring of daemons on loopback (local), live
progress (progress) and a checkpoint out as the model's own files (export).

Layer 6 of varunad, the outermost (store < cluster < control < report < node < ctl;
tests/unit/test_imports.py checks it). May import: everything of varunad, trainer.launch, protocol, and
trainer.checkpoint.export (on use: it needs torch).
Nothing of varunad imports varunad.ctl.
"""
