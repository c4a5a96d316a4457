"""Subprocess scenarios for tests/dump/test_crash_safety.py: python writer_child.py MODE DUMP_PATH [N].

  hang N         finish steps 0..N-1, then keep writing tensors of step N forever after
                 printing "in step N" (the parent SIGKILLs it)
  file_limit     RLIMIT_FSIZE makes the writer thread's writes fail (EFBIG, a real OS error);
                 prints where DumpError surfaced and its message
  exit_hooks     four writers still open at a normal exit, one step each:
                   step 0: left open (the writer module's own atexit hook finishes it)
                   step 1: closed by a user atexit hook registered BEFORE importing the writer
                   step 2: closed (with extra attrs) by a user hook registered after it
                   step 3: aborted by a user hook registered after it
"""

import atexit
import json
import os
import resource
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from dumpkit import make_row, root_attrs  # noqa: E402


def step_tensor(step: int, index: int) -> torch.Tensor:
    """What step `step` stores as tensor `index`: recomputable by the parent."""
    return torch.arange(1024, dtype=torch.float32) + 1000 * step + index


def finished_step(dump_path: str, step: int, tensors: int = 4) -> None:
    from probe.dump.writer import StepWriter

    writer = StepWriter(dump_path, step, 0, root_attrs())
    ids = [writer.add_tensor(step_tensor(step, i)) for i in range(tensors)]
    writer.add_rows([make_row(module=f"m{i}", seq=i, tensor_id=i) for i in ids])
    writer.close()


def hang(dump_path: str, steps: int) -> None:
    from probe.dump.writer import StepWriter

    for step in range(steps):
        finished_step(dump_path, step)
    writer = StepWriter(dump_path, steps, 0, root_attrs(), buffer_bytes=4 << 20)
    writer.add_rows([make_row(module="inflight")])
    index = 0
    while True:
        writer.add_tensor(torch.full((256 * 1024,), float(index)))
        if index == 3:
            print(f"in step {steps}", flush=True)
        index += 1


def file_limit(dump_path: str) -> None:
    from probe.dump.writer import StepWriter
    from probe.errors import DumpError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so the write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    writer = StepWriter(dump_path, 0, 0, root_attrs())
    where = "nowhere"
    message = ""
    try:
        for _ in range(64):
            writer.add_tensor(torch.ones(64 * 1024))  # 256 KiB each, 16 MiB in all
        where = "close"
        writer.close()
    except DumpError as error:
        where = where if where == "close" else "add_tensor"
        message = str(error)
    print(json.dumps({"where": where, "message": message, "path": writer.path}))


def open_writer(dump_path: str, step: int):
    from probe.dump.writer import StepWriter

    writer = StepWriter(dump_path, step, 0, root_attrs())
    writer.add_tensor(step_tensor(step, 0))
    writer.add_rows([make_row(module=f"left_open{step}", tensor_id=0)])
    return writer


def exit_hooks(dump_path: str) -> None:
    early = {}
    atexit.register(lambda: print("user hook closed", early["writer"].close(extra_attrs={"closed_by": "user"})))
    open_writer(dump_path, 0)
    early["writer"] = open_writer(dump_path, 1)
    late = open_writer(dump_path, 2)
    atexit.register(lambda: late.close(extra_attrs={"closed_by": "user"}))
    atexit.register(open_writer(dump_path, 3).abort)


def main() -> None:
    mode, dump_path = sys.argv[1], sys.argv[2]
    if mode == "hang":
        hang(dump_path, int(sys.argv[3]))
    elif mode == "file_limit":
        file_limit(dump_path)
    elif mode == "exit_hooks":
        exit_hooks(dump_path)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
