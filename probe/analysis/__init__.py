"""Analyses of one run's dumps: the first non-finite value and its cause (nonfinite.py,
nonfinite_cause.py) and whether two runs of the same program are bit-identical
(determinism.py)."""
