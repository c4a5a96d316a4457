"""Compare two dumps: align calls, measure errors, judge, find the first divergence.

The public entry point is ``probe.compare(a, b, **options)`` (probe.comparison.api.compare).
The package is not called ``compare`` so that importing it can never replace the
``probe.compare`` function with a module. Nothing here imports torch.
"""
