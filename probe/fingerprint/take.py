"""Taking one step's fingerprint: statistics and the sketch of every parameter, gradient
and optimizer-state tensor (torch; never h5py).

The numbers are capture's own (capture/numbers/: stats.py, sketch.py, bulk_stats.py),
so a fingerprint's sketch and a step file's sketch of the same tensor are the same numbers.

* CPU tensors (of more than SMALL elements, when a step has BULK_MIN smaller ones): ``stats.host_stats_and_sketch`` per tensor
  (numpy passes over the values, no torch dispatch per statistic).
* Other devices, and small CPU tensors: ``bulk_stats.bulk_device_stats`` for all of them at once, a
  fixed handful of launches per (device, dtype), then one non-blocking copy of the whole
  step to pinned host memory. Nothing waits for the device inside the step: the copy is read
  when the step is written, which the recorder does at the next optimizer step (or at the
  end of the run), by when it has long finished.

Which tensors: every parameter of every param group of the optimizer that stepped, its
gradient when it has one, and each floating-point state tensor of more than one element
(Adam's exp_avg and exp_avg_sq; the scalar step counters are left out). Names come from the
model when the debugger knows it (``fc1.weight``), else from the position in the optimizer
(``opt0.param3``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from probe.capture.numbers import bulk_stats, stats
from probe.fingerprint import schema

_NAN_SKETCH: dict = {}


def _nan_sketch(k: int) -> np.ndarray:
    found = _NAN_SKETCH.get(k)
    if found is None:
        found = _NAN_SKETCH[k] = np.full(k, np.nan)
    return found


def describe(name: str, kind: str, param: str, state: str, tensor: torch.Tensor) -> dict:
    return {"name": name, "kind": kind, "param": param, "state": state,
            "dtype": stats.dtype_name(tensor.dtype), "shape": list(tensor.shape),
            "numel": int(tensor.numel())}


def optimizer_tensors(optimizer, names: dict, prefix: str) -> list[tuple[str, str, str, str, torch.Tensor]]:
    """(name, kind, param name, state key, tensor) of one optimizer, in a fixed order:
    per parameter, the parameter, its gradient, its state tensors (sorted keys)."""
    found = []
    position = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            label = names.get(id(param)) or f"{prefix}.param{position}"
            position += 1
            found.append((schema.tensor_name("param", label), "param", label, "", param))
            grad = param.grad
            if grad is not None and not grad.is_sparse:
                found.append((schema.tensor_name("grad", label), "grad", label, "", grad))
            state = optimizer.state.get(param)
            if state:
                for key in sorted(state, key=str):
                    value = state[key]
                    if (isinstance(value, torch.Tensor) and value.is_floating_point()
                            and value.numel() > 1 and not value.is_sparse):
                        found.append((schema.tensor_name("state", label, str(key)), "state", label,
                                      str(key), value))
    return found


class PendingPrint:
    """One step's fingerprint, maybe still on its way from the device: ``resolve()`` gives
    (loss, names, numbers (tensors, 6), sketches (tensors, k)), numpy arrays made whole (a
    step of a large model has thousands of tensors: nothing is done per tensor here)."""

    def __init__(self, step: int, k: int) -> None:
        self.step = step
        self.k = k
        self.loss: float | torch.Tensor = math.nan
        self._host: list = []  # (name, numbers tuple, packed sketch or None)
        self._device = None  # (names, numels, host values, host counts, event)
        self._more: list = []  # other optimizers' parts of the step (extend)

    @property
    def on_device(self) -> bool:
        """Does the step wait for a copy from an accelerator?"""
        return any(part._device is not None and part._device[4] is not None for part in (self, *self._more))

    def extend(self, other: "PendingPrint") -> None:
        """Add another optimizer's tensors of the same step."""
        self._host.extend(other._host)
        self._more.append(other)

    def resolve(self) -> tuple[float, list, np.ndarray, np.ndarray]:
        k = self.k
        names = [name for name, _, _ in self._host]
        numbers = [np.array([entry[1] for entry in self._host], dtype=np.float64).reshape(-1, 6)]
        missing = _nan_sketch(k).tobytes()
        blob = b"".join(packed if packed is not None and len(packed) == 8 * k else missing
                        for _, _, packed in self._host)
        sketches = [np.frombuffer(blob, dtype=np.float64).reshape(-1, k)]
        for part in (self, *self._more):
            if part._device is not None:
                part_names, part_numbers, part_sketches = part._device_rows()
                names += part_names
                numbers.append(part_numbers)
                sketches.append(part_sketches)
        loss = self.loss
        if isinstance(loss, torch.Tensor):
            loss = float(loss)
        return loss, names, np.concatenate(numbers), np.concatenate(sketches)

    def _device_rows(self) -> tuple[list, np.ndarray, np.ndarray]:
        names, numels, values, counts, event = self._device
        if event is not None:
            event.synchronize()
        numbers = np.empty((len(names), 6))
        numbers[:, :4] = values[:, :4]
        numbers[:, 2] /= np.asarray(numels, dtype=np.float64)  # the sum -> the mean
        numbers[:, 4:] = counts
        return list(names), numbers, values[:, 4:4 + self.k]


#: CPU tensors up to SMALL elements go through the bulk path with the device tensors (a fixed
#: number of torch calls for all of them) when a step has at least BULK_MIN of them: one by
#: one, Python's overhead per tensor is most of their cost (measured on a loaded 2-core
#: machine: DeepMLP's 294 small tensors, 46 ms one by one, 25 ms in bulk), but the bulk path's
#: fixed cost (about 2.5 ms) is more than 16 small tensors cost one by one
SMALL = 16384
BULK_MIN = 64


def take(step: int, tensors: list[tuple[str, torch.Tensor]], k: int) -> PendingPrint:
    """Statistics and sketches of ``tensors`` [(name, tensor)], without waiting for a device."""
    pending = PendingPrint(step, k)
    bulk = []
    small = sum(1 for _, tensor in tensors if tensor.device.type == "cpu" and tensor.numel() <= SMALL)
    threshold = SMALL if small >= BULK_MIN else -1
    for name, tensor in tensors:
        if tensor.numel() == 0:
            pending._host.append((name, stats.EMPTY_STATS, None))
        elif tensor.device.type == "cpu" and tensor.numel() > threshold:
            numbers, packed = stats.host_stats_and_sketch(tensor, k)
            pending._host.append((name, numbers, packed))
        else:
            bulk.append((name, tensor))
    if bulk:
        pending._device = _device_part(bulk, k)
    return pending


def _device_part(on_device: list, k: int):
    """The statistics and sketches of the step's device tensors, copied to the host without
    a synchronisation (an event marks when the copy is done)."""
    names = [name for name, _ in on_device]
    tensors = [tensor.detach() for _, tensor in on_device]
    pairs = bulk_stats.bulk_device_stats(tensors, k)
    width = 4 + k
    values = torch.stack([torch.nn.functional.pad(v, (0, width - v.shape[0]), value=math.nan)
                          if v.shape[0] < width else v for v, _ in pairs])
    counts = torch.stack([c for _, c in pairs])
    device = values.device
    pinned = device.type == "cuda"
    host_values = torch.empty(values.shape, dtype=values.dtype, pin_memory=pinned)
    host_counts = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=pinned)
    host_values.copy_(values, non_blocking=pinned)
    host_counts.copy_(counts, non_blocking=pinned)
    event = None
    if pinned:
        event = torch.cuda.Event()
        event.record()
    return names, [t.numel() for t in tensors], host_values.numpy(), host_counts.numpy(), event


__all__ = ["take", "optimizer_tensors", "describe", "PendingPrint"]
