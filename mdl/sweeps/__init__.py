"""Sweep tooling: the cost estimate (cost.py, ``python -m mdl.sweeps.cost``), launcher checks before a
multirun starts (checks.py), and the jobs a sweep planned (jobs.py)."""
