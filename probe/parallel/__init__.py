"""A compare spread over processes: ``probe compare --jobs N`` on this machine (workers.py),
``torchrun ... -m probe compare A B`` over machines (torchrun.py), the summaries they send each
other as JSON (wire.py). The compare itself (probe/comparison) knows none of this: it runs the
units it is handed a runner for. The package's __init__ imports nothing."""
