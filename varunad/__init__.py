"""varunad: the control plane (etcd membership, leader election, planning, morphing, varunactl)."""

__version__ = "0.1.0"
