"""`python -m probe ...` is the same as the `probe` console script."""

from probe.cli import main

main()
