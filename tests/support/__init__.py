"""Test support shared by the layers: the real control plane (plane.py, pki.py, processes.py)
and what this machine can run (environment.py). Imported as `support.*` (tests/ is on sys.path).
"""
