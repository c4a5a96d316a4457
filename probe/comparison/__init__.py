"""Compare two dumps: align calls, measure errors, judge, find the first divergence.

The public entry point is ``probe.compare(a, b, **options)`` (probe.comparison.api.compare).
The package is not called ``compare`` so that importing it can never replace the
``probe.compare`` function with a module. Nothing here imports torch.
"""

#: records whose rows a compare keeps for the report's tables (--keep-rows): past it, those of
#: the pairs of step files that diverged first, then in step and rank order (assemble.py); a
#: constant here so that ``probe compare --help`` shows it without loading the compare
KEEP_ROWS = 20_000
