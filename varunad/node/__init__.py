"""One VM's daemon: the process (daemon), its settings (config), supervision of its workers and
what they report (supervisor, reporter, log_shipper), the ZeroMQ server and clients between daemons (peers), the Unix control channel to its workers,
Prometheus metrics, local housekeeping and job signatures.

May import: varunad.store, varunad.cluster, varunad.control, trainer.planning, trainer.worker_env,
trainer.launch, trainer.net.netaddr, trainer.engine.control (the workers' side of the channel),
protocol. Never torch at import time: the daemon image starts without it.
"""
