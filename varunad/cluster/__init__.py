"""The fleet as a cluster: membership under leases, leader election with fencing, what a daemon says
about itself (facts), the fleet snapshot of one leader cycle, and epoch-fenced writes.

May import: varunad.store, varunad.control's value types (jobs, plans, records: the snapshot parses
them), protocol. Never varunad.node or varunad.ctl.
"""
