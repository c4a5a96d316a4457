"""`python -m probe ...` is the same as the `probe` console script."""

from probe.cli import main

if __name__ == "__main__":  # a worker process of ``probe compare --jobs N`` imports this module too
    main()
