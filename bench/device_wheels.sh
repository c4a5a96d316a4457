#!/bin/sh
# Wheels a lent GPU machine lacks for bench/device_check.py's msprobe columns, downloaded here
# into .whl/ (git-ignored through .git/info/exclude) for the device tool's `carry`. The machine
# runs Python 3.12 and cannot reach PyPI; its image already holds msprobe's other needs
# (numpy, pandas, matplotlib, einops, tensorboard, psutil, pyyaml, tqdm).
#
#   sh bench/device_wheels.sh            # then carry [".whl"]; docs/performance.md, "On a lent GPU"
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    mindstudio-probe==26.2.0 openpyxl et-xmlfile pytz skl2onnx
ls -l .whl
