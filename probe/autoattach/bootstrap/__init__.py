"""The folder ``probe run`` puts first on a child's PYTHONPATH (see probe/autoattach)."""
