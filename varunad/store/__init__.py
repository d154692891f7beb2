"""The control plane's only door to etcd: the async store contract, its values and errors
(contract), its etcd implementation (etcd: the requests, over etcd_connection: the clients and
reconnects, over aetcd's client in etcd_client), the key names
(keys: one keyspace module) and the shape check of every document read back (schemas). Everything above
imports the contract; only what opens a store imports etcd.

Layer 1 of varunad (store < cluster < control < report < node < ctl; tests/unit/test_imports.py checks it).
May import: the standard library, aetcd. Nothing else of varunad (schemas names its document types
as "module:attr" strings, imported lazily), nothing of trainer.
"""
