"""Where a tensor lives is not a numerical difference.

Two runs of the same code on a CPU and on a GPU (or an NPU, XPU, MPS device) pass the
device around: ``torch.arange(n, device=x.device)``, ``x.to(device)``, ``x.cuda()``,
``torch.tensor(1.0, device="cpu")``, ``non_blocking=True``, ``pin_memory=True``. Those
arguments differ between the runs by design, so compare treats them as placement, never as a
changed argument: the row matches, carries a note, and the report says once that the runs
ran on different devices (device_note).
"""

from __future__ import annotations

import re

from probe.comparison.metrics import parse_value

#: torch's device types (torch._C._get_privateuse1_backend_name aside); "cuda:0", "npu:3"
_DEVICE = re.compile(
    r"^(cpu|cuda|npu|xpu|mps|hpu|xla|meta|mtia|ipu|lazy|ve|vulkan|hip|privateuseone|maia|fpga|ort)(:\d+)?$"
)
#: argument names that only say where or how a tensor is placed (never its values)
PLACEMENT_ARGS = ("device", "non_blocking", "pin_memory")
#: calls that only move a tensor between devices (or pin it): their output equals their input
MOVE_OPS = ("Tensor.cuda", "Tensor.cpu", "Tensor.npu", "Tensor.xpu", "Tensor.mps", "Tensor.pin_memory")


def is_device_text(text: str) -> bool:
    """A recorded value that names a device: "cpu", "cuda:0", torch.device('npu', 1)."""
    value = parse_value(text)
    if not isinstance(value, str):
        return False
    value = value.strip()
    match = re.match(r"^device\(type='(\w+)'(?:, index=(\d+))?\)$", value)
    if match:
        value = match.group(1) + (f":{match.group(2)}" if match.group(2) else "")
    return bool(_DEVICE.match(value))


def is_placement_slot(slot: str) -> bool:
    """kwarg.device, kwarg.non_blocking, kwarg.pin_memory (nested or not)."""
    return slot.startswith("kwarg.") and slot.split(".")[1] in PLACEMENT_ARGS


def is_placement_pair(slot: str, text_a: str, text_b: str) -> bool:
    """Two recorded values of one argument that differ only by where the tensor lives: both
    name a device (a positional ``.to("cuda:0")`` included), or the argument is a placement
    argument (device=, non_blocking=, pin_memory=)."""
    if is_placement_slot(slot):
        return True
    return is_device_text(text_a) and is_device_text(text_b)


def device_note(device_a: str, device_b: str, arguments: int, moves: int = 0) -> str:
    """The one report note for runs on different devices."""
    where = f"the runs ran on different devices ({device_a or '?'} in A, {device_b or '?'} in B)"
    if arguments:
        where += (f"; {arguments} placement argument{'s' if arguments != 1 else ''} (device=, .to(device), "
                  "non_blocking, pin_memory) differ and are not compared: where a tensor lives is not a "
                  "numerical difference")
    if moves:
        where += (f"; {moves} device move{'s' if moves != 1 else ''} ({', '.join(MOVE_OPS[:3])}, ...) in one run "
                  "only (without partner, not a divergence)")
    return where
