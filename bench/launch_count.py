"""Torch ops that launch a kernel on a GPU, counted on any device (a TorchDispatchMode).

    python bench/launch_count.py                    # the GPT at levels api and mix, device path
    python bench/launch_count.py --models gpt,deepmlp --levels api

On a GPU a step's cost for the host is its launches: every aten op that computes something
launches at least one kernel. This counts the aten ops a step dispatches, leaving out those
that launch nothing: views (``is_view``), allocations without values (``empty`` and its
family), ``detach``, metadata queries and other ops that only change a tensor's header. Host
reads (``_local_scalar_dense``: ``.item()``, ``float(t)``) are counted apart, as they make the
host wait. A TorchDispatchMode sees the ops as the device would run them: after autograd and
after the composite ops are broken up, including the backward pass and probe's own ops.
The device bucket's Triton kernel (on a GPU) is no aten op: its launches are read from
probe's own counter and listed as ``triton bucket kernel``.

The device path's target (docs/performance.md): a captured step's launches at most 1.25x
the plain step's + 30, no ``clone`` or ``copy_`` per record, one copy to the host per step.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

#: aten ops (packet names) that launch no kernel: allocations without values, header changes
#: and queries. Views are recognised by the op's own ``is_view``.
NO_KERNEL = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
    "resize_as_", "set_", "detach", "detach_", "lift_fresh", "alias", "_unsafe_view",
    "_reshape_alias", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "is_same_size", "_has_compatible_shallow_copy_type", "record_stream", "is_pinned",
    "_pin_memory", "requires_grad_", "retain_grad", "_version", "is_coalesced", "_nnz",
    "size", "stride", "dim", "numel", "storage_offset", "is_contiguous", "is_nonzero",
    "_make_dep_token", "_conj", "_neg_view", "resolve_conj", "resolve_neg",
})
#: the name the bucket's Triton kernel launches are counted under (not an aten op)
TRITON = "triton bucket kernel"
#: ops that read a device number on the host (the host waits for the device)
HOST_READS = frozenset({"_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero",
                        "masked_select", "allclose"})


class LaunchCounter(TorchDispatchMode):
    """Counts the kernel-launching aten ops dispatched while it is active (``launches``, by op
    name) and the host reads (``host_reads``)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: collections.Counter = collections.Counter()
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.host_reads += 1
        elif name not in NO_KERNEL and not func.is_view:
            self.launches[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.launches.values())


def count(step) -> LaunchCounter:
    """The launches of one call of ``step()`` (run it once before: warm tables and layouts)."""
    from probe.capture.numbers import bucket_kernel

    counter = LaunchCounter()
    before = bucket_kernel.launches
    with counter:
        step()
    if bucket_kernel.launches > before:
        counter.launches[TRITON] += bucket_kernel.launches - before
    return counter


def captured_step(debugger, model, train):
    """start(model), the step, stop(), step(): one captured step as a function."""
    def run():
        debugger.start(model)
        train()
        debugger.stop()
        debugger.step()
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--models", default="gpt", help="comma-separated: gpt, mlp, convnet, deepmlp")
    parser.add_argument("--levels", default="api,mix", help="comma-separated capture levels")
    parser.add_argument("--host-path", action="store_true",
                        help="count the CPU's own path instead of the device path")
    parser.add_argument("--top", type=int, default=8, help="ops listed per captured step")
    args = parser.parse_args(argv)
    if not args.host_path:
        os.environ["PROBE_DEVICE_PATH"] = "1"

    import examples.models as models
    from probe.config import Config
    from probe.debugger.debugger import PrecisionDebugger

    torch.set_num_threads(1)
    constructors = {"gpt": ("TinyGPT", 1), "mlp": ("MLP", 32), "convnet": ("SmallConvNet", 32),
                    "deepmlp": ("DeepMLP", 32)}
    print("| model | level | plain | captured | ratio | allowed (1.25x + 30) | host reads | "
          "host transfers | most launched by the capture |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in [m for m in args.models.split(",") if m]:
        constructor, batch_size = constructors[key]
        torch.manual_seed(0)
        model = getattr(models, constructor)()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batch = models.make_batch(key, batch_size, generator=torch.Generator().manual_seed(0))

        def train():
            models.train_step(model, optimizer, *batch)

        train()
        plain = count(train)
        for level in [m for m in args.levels.split(",") if m]:
            debugger = PrecisionDebugger(Config(dump_path=tempfile.mkdtemp(), level=level))
            step = captured_step(debugger, model, train)
            step()
            captured = count(step)
            debugger.close()
            transfers = _last_host_transfers(debugger)
            extra = captured.launches - plain.launches
            top = ", ".join(f"{name} {n}" for name, n in extra.most_common(args.top))
            allowed = 1.25 * plain.total + 30
            print(f"| {key} | {level} | {plain.total} | {captured.total} | "
                  f"{captured.total / plain.total:.2f}x | {allowed:.0f} | {captured.host_reads} | "
                  f"{transfers} | {top} |")
    return 0


def _last_host_transfers(debugger) -> str:
    """cost.host_transfers of the debugger's last step file."""
    from probe.dump.reader import load

    try:
        dump = load(debugger.config.dump_path)
        with dump.open(dump.steps[-1]) as step_file:
            return str(step_file.attrs.get("cost", {}).get("host_transfers", "-"))
    except Exception:  # noqa: BLE001 - a benchmark column, not a check
        return "-"


if __name__ == "__main__":
    sys.exit(main())
