"""Throughput of StepWriter and the reader (not a test): python tests/scripts_dump/measure_io.py [DIR]

Prints one markdown table, best of REPEATS runs per case. Each run starts after os.sync(); "raw" writes the same bytes with
numpy.tofile into one file, the ceiling for this disk. Neither fsyncs. Reads hit the page
cache (the file was just written), so read numbers are the library's cost, not the disk's.
"""

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from dumpkit import rows_for, root_attrs  # noqa: E402
from probe.dump import reader  # noqa: E402
from probe.dump.writer import StepWriter  # noqa: E402

REPEATS = 3


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


def raw_write(folder, tensors):
    """The same bytes through numpy.tofile into one file: this disk's ceiling."""
    start = time.perf_counter()
    with open(os.path.join(folder, "raw.bin"), "wb") as handle:
        for tensor in tensors:
            bits = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
            bits.numpy().tofile(handle)
    return time.perf_counter() - start


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
    print("| case | MB | probe write MB/s | raw tofile MB/s | probe/raw | add_tensor total ms | read+decode MB/s |")
    print("|---|---|---|---|---|---|---|")
    for step, (name, tensors, rows) in enumerate(cases):
        megabytes = sum(t.numel() * t.element_size() for t in tensors) / 1e6
        seconds = caller = raw_s = read_s = float("inf")
        for _ in range(REPEATS):  # best of REPEATS: the disk is shared, noise only adds time
            os.sync()  # every run starts with no dirty pages
            path, write_s, add_s = write_case(folder, step, tensors, rows)
            seconds, caller = min(seconds, write_s), min(caller, add_s)
            os.sync()
            raw_s = min(raw_s, raw_write(folder, tensors)) if tensors else float("nan")
            read_s = min(read_s, read_case(path)[0])
        if megabytes:
            print(f"| {name} | {megabytes:.0f} | {megabytes / seconds:.0f} | {megabytes / raw_s:.0f} | "
                  f"{raw_s / seconds:.2f} | {caller * 1e3:.1f} | {megabytes / read_s:.0f} |")
        else:
            print(f"| {name} | - | close {seconds:.2f} s | - | - | - | records read {read_s:.2f} s |")
    if len(sys.argv) <= 1:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
