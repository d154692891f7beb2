"""The fleet as a cluster: membership under leases, leader election with fencing, what a daemon says
about itself (facts), and epoch-fenced writes.

Layer 2 of varunad (store < cluster < control < report < node < ctl; tests/unit/test_imports.py checks it).
May import: varunad.store, protocol. Never varunad.control, report, node or ctl.
"""
