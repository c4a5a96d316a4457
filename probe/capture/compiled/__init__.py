"""Seeing inside compiled graphs: the dynamo backend that taps a graph's values and gradients,
with the calls named as the eager run names them (see probe/capture/__init__.py)."""
