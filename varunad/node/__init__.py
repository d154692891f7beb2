"""One VM's daemon: the process (daemon) and its plan follower (follower), its settings (config),
the leader loop it runs while it leads (leader, leader_planning, leader_pace), supervision of its workers and
what they report (supervisor, stopping, reporter, log_shipper), the spare worker processes kept per
slot (spares), the ZeroMQ server and clients between daemons (peers), the Unix control channel to
its workers (control_channel), Prometheus metrics, local housekeeping and job signatures.

Layer 5 of varunad (store < cluster < control < report < node < ctl; tests/unit/test_imports.py checks it).
May import: varunad.store, varunad.cluster, varunad.control, varunad.report (the leader writes the
end-of-job report, lazily), trainer.planning, trainer.worker_env,
trainer.launch, trainer.net.netaddr, trainer.engine.control (the workers' side of the channel),
trainer.spare (what a spare runs), protocol. Never torch at import time: the daemon image starts without it.
"""
