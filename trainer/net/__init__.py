"""The network below the engine: binding transports to the advertised address (netaddr), the
torch.distributed rendezvous store, and the link probe between two hosts.

May import: trainer.engine.comm and trainer.profiler (the link probe, lazily), trainer.errors,
protocol, torch. Never varunad.
"""
