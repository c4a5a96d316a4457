"""Throughput of StepWriter and the reader (not a test): python tests/scripts_dump/measure_io.py [DIR]

Prints one markdown table. Reads hit the page cache (the files were just written), so read
numbers are the library's cost, not the disk's. The raw row writes the same bytes with
numpy.tofile + fsync-free close, as the ceiling for this disk.
"""

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dumpkit import rows_for, root_attrs  # noqa: E402
from probe.dump import reader  # noqa: E402
from probe.dump.writer import StepWriter  # noqa: E402


def write_case(folder, step, tensors, rows=()):
    start = time.perf_counter()
    writer = StepWriter(folder, step, 0, root_attrs())
    caller = 0.0
    for tensor in tensors:
        t0 = time.perf_counter()
        writer.add_tensor(tensor)
        caller += time.perf_counter() - t0
    writer.add_rows(list(rows))
    path = writer.close()
    return path, time.perf_counter() - start, caller


def read_case(path):
    start = time.perf_counter()
    with reader.open_step_file(path) as step_file:
        total = sum(step_file.tensor(i).nbytes for i in range(step_file.tensor_count))
        records = step_file.records.to_dicts()
    return time.perf_counter() - start, total, len(records)


def main():
    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="probe-io-")
    torch.manual_seed(0)
    cases = [
        ("200 x 1 MiB float32", [torch.randn(256 * 1024) for _ in range(200)], ()),
        ("200 x 1 MiB bfloat16", [torch.randn(512 * 1024).bfloat16() for _ in range(200)], ()),
        ("20 x 10 MiB float32", [torch.randn(2560 * 1024) for _ in range(20)], ()),
        ("5000 x 1 KiB float32", [torch.randn(256) for _ in range(5000)], ()),
        ("100k records, no tensors", [], rows_for(100_000)),
    ]
    print(f"| case | data MB | write s | write MB/s | add_tensor total s | read+decode s | read MB/s |")
    print("|---|---|---|---|---|---|---|")
    for step, (name, tensors, rows) in enumerate(cases):
        megabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6
        path, seconds, caller = write_case(folder, step, tensors, rows)
        read_s, _, _ = read_case(path)
        write_rate = f"{megabytes / seconds:.0f}" if megabytes else "-"
        read_rate = f"{megabytes / read_s:.0f}" if megabytes else "-"
        print(f"| {name} | {megabytes:.0f} | {seconds:.3f} | {write_rate} | {caller:.3f} | {read_s:.3f} | {read_rate} |")
    blob = np.random.default_rng(0).standard_normal(50 * 1024 * 1024, dtype=np.float32)  # 200 MiB
    start = time.perf_counter()
    blob.tofile(os.path.join(folder, "raw.bin"))
    seconds = time.perf_counter() - start
    print(f"| raw numpy.tofile, one 200 MiB array | {blob.nbytes / 1e6:.0f} | {seconds:.3f} | "
          f"{blob.nbytes / 1e6 / seconds:.0f} | - | - | - |")
    if len(sys.argv) <= 1:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
