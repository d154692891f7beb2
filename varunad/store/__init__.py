"""The control plane's only door to etcd: the async store contract and its etcd implementation
(etcd), the key names (keys, fleetkeys) and the shape check of every document read back (schemas).

Layer 1 of varunad (store < cluster < control < report < node < ctl; tests/test_imports.py checks it).
May import: the standard library, aetcd. Nothing else of varunad (schemas names its document types
as "module:attr" strings, imported lazily), nothing of trainer.
"""
