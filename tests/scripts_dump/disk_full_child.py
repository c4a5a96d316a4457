"""python disk_full_child.py CONFIG STEPS [FSIZE_LIMIT]: train a small MLP for STEPS steps under
PrecisionDebugger(CONFIG) on a disk that fills up, and print one JSON object on stdout:

  steps_written   the steps no DumpError named as lost
  errors          [{"step", "where", "message"}]: the step a DumpError named as not written
                  (with the writer process, a step's error surfaces at a later step() or at
                  close()) and where it surfaced ("start", "forward", "backward",
                  "optimizer", "stop", "step", "close")
  warnings        probe warnings seen
  optimizer_ok    every optimizer step updated every parameter (no half-applied step)
  open_h5         HDF5 files, groups, datasets and attributes still open at the end
                  (h5py's own ~30 global datatype ids do not count)

FSIZE_LIMIT (bytes): the portable simulation of a full disk, RLIMIT_FSIZE (EFBIG); SIGXFSZ is
ignored so the kernel answers with an error instead of killing the process.
A crash (SIGSEGV in HDF5) shows as a negative return code in the parent.
"""

import json
import os
import re
import resource
import signal
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from probe import PrecisionDebugger  # noqa: E402
from probe.errors import DumpError  # noqa: E402


def main() -> None:
    config, steps = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(sys.argv[3])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = PrecisionDebugger(config)
    errors, optimizer_ok = [], True

    def lost(error, where):
        named = re.match(r"step (\d+) was not written", str(error))
        errors.append({"step": int(named.group(1)) if named else None, "where": where,
                       "message": str(error)})

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(steps):
            where = "start"
            try:
                debugger.start(model)
                where = "forward"
                # the batch grows with the step, so do the step files: later steps stop fitting
                loss = model(torch.randn(32 * (step + 1), 64)).square().mean()
                where = "backward"
                optimizer.zero_grad()
                loss.backward()
                where = "optimizer"
                before = [p.detach().clone() for p in model.parameters()]
                optimizer.step()
                changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
                optimizer_ok = optimizer_ok and all(changed)
                where = "stop"
                debugger.stop()
                where = "step"
                debugger.step()
            except DumpError as error:
                lost(error, where)
                if debugger.started:
                    debugger.stop()
                if where != "step":
                    debugger.step()
        for _ in range(steps + 1):  # close() raises once per step still to report
            try:
                debugger.close()
                break
            except DumpError as error:
                lost(error, "close")
    failed = {error["step"] for error in errors}
    written = [step for step in range(steps) if step not in failed]
    import h5py

    print(json.dumps({
        "steps_written": written,
        "errors": errors,
        "warnings": [str(w.message) for w in seen if "probe" in str(w.message)],
        "optimizer_ok": optimizer_ok,
        "open_h5": sum(h5py.h5i.get_type(i) != h5py.h5i.DATATYPE for i in h5py.h5f.get_obj_ids()),
    }))


if __name__ == "__main__":
    main()
