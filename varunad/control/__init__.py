"""The control plane's decisions: the leader's loop, plan documents and how they are made, jobs and
their state, worker records, failure rules, measured links, and etcd outages.

May import: varunad.store, varunad.cluster, trainer.planning (the planner), varunad.node's config,
metrics and peers (the leader runs inside a daemon), varunad.report (lazily), protocol.
"""
