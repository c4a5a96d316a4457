"""Remake tests/data/msprobe/: small real msprobe dumps the tests read without the package.

    python3 -m venv /tmp/msvenv
    /tmp/msvenv/bin/pip install torch==2.13.0 mindstudio-probe==26.2.0
    /tmp/msvenv/bin/python tests/scripts/make_msprobe_fixtures.py

Each dump is msprobe_dumps.py run once in its own process (mindstudio-probe patches torch for
the rest of the process it runs in). To keep the files small, every dump but mlp_a loses its
stack.json (probe reads it for the source line of each call, and does without), and the
process folder of each step is renamed proc0 (msprobe names it after the process id, which
differs every run). Nothing else is changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "data", "msprobe")
SCRIPT = os.path.join(ROOT, "tests", "scripts", "msprobe_dumps.py")
TENSOR = ["--task", "tensor", "--level", "L1", "--list", "linear", "--data-mode", "forward"]

#: folder -> msprobe_dumps.py arguments
DUMPS = {
    "mlp_a": ["--steps", "2"],
    "mlp_b": ["--steps", "2"],
    "mlp_extra_call": ["--variant", "extra_call"],
    "mlp_bf16": ["--variant", "bf16"],
    "mlp_scaled": ["--variant", "scaled"],
    "mlp_l0": ["--level", "L0"],
    "mlp_l1": ["--level", "L1"],
    "mlp_nonfinite": ["--variant", "nonfinite", "--level", "L1"],
    "mlp_md5": ["--level", "L1", "--summary-mode", "md5"],
    "mlp_ranks": ["--level", "L1", "--ranks", "2"],
    "mlp_tensor_a": TENSOR,
    "mlp_tensor_bf16": TENSOR + ["--variant", "bf16"],
}


def make(name: str, arguments: list[str]) -> None:
    folder = os.path.join(OUT, name)
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([sys.executable, SCRIPT, folder, *arguments], check=True, capture_output=True)
    for step in sorted(os.listdir(folder)):
        for process in os.listdir(os.path.join(folder, step)):
            path = os.path.join(folder, step, process)
            if name != "mlp_a":
                os.remove(os.path.join(path, "stack.json"))
            if process.startswith("proc"):
                os.rename(path, os.path.join(folder, step, "proc0"))


def main() -> None:
    import torch
    from importlib.metadata import version

    os.makedirs(OUT, exist_ok=True)
    for name, arguments in DUMPS.items():
        make(name, arguments)
        print(f"made {name}")
    with open(os.path.join(OUT, "made_with.json"), "w") as handle:
        json.dump({"mindstudio-probe": version("mindstudio-probe"), "torch": torch.__version__,
                   "dumps": DUMPS}, handle, indent=1)


if __name__ == "__main__":
    main()
