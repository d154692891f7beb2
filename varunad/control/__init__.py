"""The control plane's data and pure decisions: plan documents and how they are made, jobs and their
state, worker records, failure rules, measured links, each slot's measured speed (speeds), etcd outages, the fleet snapshot of one leader
cycle (fleet), what the leader does next given a snapshot (decide) and a job's status as etcd tells
it (status). The loop that acts on them, the leader, runs inside a daemon and lives in varunad.node.

Layer 3 of varunad (store < cluster < control < report < node < ctl; tests/unit/test_imports.py checks it).
May import: varunad.store, varunad.cluster, trainer.planning (the planner), protocol.
Never varunad.report, node or ctl.
"""
