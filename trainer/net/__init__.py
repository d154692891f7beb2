"""The network below the engine: binding transports to the advertised address (netaddr), the
ports workers bind (ports: below the kernel's ephemeral range) and the torch.distributed
rendezvous store. (The link probe, which measures a link with the engine's
transports, is above the engine: trainer/linkprobe.py.)

May import: trainer.errors, protocol, torch. Never the engine, the profiler or varunad.
"""
