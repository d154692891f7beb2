"""varunactl: the command line (cli), the fleet commands it runs through etcd (commands), the local
ring of daemons on loopback (local) and live progress (progress).

May import: everything of varunad (it is the outermost layer), trainer.launch, protocol.
Nothing imports varunad.ctl except varunad.report.
"""
