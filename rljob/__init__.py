"""rljob: a Kubernetes operator for colocated reinforcement-learning jobs.

This package holds what the operator and the worker share (the API models, the memory report)
and the `rljob` command line; it imports neither kopf nor torch at module level.
"""

__version__ = "0.1.0"
