"""What several examples share: their usual command-line options and a short compare summary.

Each example stays readable on its own; only code that is the same everywhere lives here.
Importing this module does not import torch (the distributed driver never does).
"""

import argparse
import os


def example_parser(doc, name, smoke_help, device=True):
    """An ArgumentParser with the options every example has: --out (default ./out/<name>),
    --smoke (the CI size, described by smoke_help) and, unless device=False, --device
    (cuda when there is a GPU, else cpu)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if device:
        import torch

        parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.path.join("out", name),
                        help=f"folder for the dumps and the report (default ./out/{name})")
    parser.add_argument("--smoke", action="store_true", help=f"CI size: {smoke_help}")
    return parser


def print_compare_summary(result, dumps, html, indent="   "):
    """The verdict, the first divergence, the op adding the most error, and where the dumps
    and the HTML report are."""
    print(f"{indent}verdict: {result.verdict}")
    first = result.first_divergence
    if first is not None:
        print(f"{indent}first divergence: {first.key} ({first.origin})")
    if result.top_ops:
        worst = result.top_ops[0]
        print(f"{indent}op adding the most error: {worst.module or '<root>'} {worst.op}#{worst.index} "
              f"({worst.phase}): {worst.introduced:.2g} x tolerance, output rel L2 {worst.output_rel_l2:.2e}")
    print(f"{indent}dumps: {'  '.join(dumps)}")
    print(f"{indent}report: {html}")
