"""Taking one step's fingerprint: statistics and the sketch of every parameter, gradient
and optimizer-state tensor (torch; never h5py).

The numbers are capture's own, routed as capture routes a recorded tensor
(``probe.capture.numbers_of``), so a fingerprint's sketch and a step file's sketch of the same
tensor are the same numbers:

* CPU float32/float64 tensors: capture's ``HostBatch``. A tensor of at most SMALL_MAX values
  is copied into the batch's arena (one numpy copy) and computed with all the others when the
  step is written: a fixed number of numpy and torch calls per step instead of about ten per
  tensor, which on a small model's tensors (biases, norms) cost several times their
  arithmetic. A larger tensor's statistics are computed at once (each pass over values still
  in the cache) and only its sketch's fold goes to the arena. Other dtypes: per tensor. A
  batched small tensor's mean and norm are summed per row of BLOCK values, then in float64:
  the same numbers up to rounding.
* Accelerator tensors (and CPU tensors with PROBE_DEVICE_PATH=1, for the tests): one
  ``DeviceBucket`` for the step, flushed at once (a fixed number of launches per device,
  however many tensors, computed before the next step writes them); its one copy to the host
  is made when the step is written, which the recorder does at the next step's end (or at
  close()), by when the device has long finished: nothing waits for the device inside the
  step.

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

from probe.capture import DeviceBucket, HostBatch, device_path_on_cpu, dtype_name, numbers_of
from probe.capture import resolve_device_stats
from probe.fingerprint import schema

_NAN_SKETCH: dict = {}


def _nan_sketch(k: int) -> np.ndarray:
    found = _NAN_SKETCH.get(k)
    if found is None:
        found = _NAN_SKETCH[k] = np.full(k, np.nan)
    return found


def describe(name: str, kind: str, param: str, state: str, tensor: torch.Tensor) -> dict:
    return {"name": name, "kind": kind, "param": param, "state": state,
            "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
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
    (loss, names, numbers (tensors, 6), sketches (tensors, k))."""

    def __init__(self, step: int, k: int) -> None:
        self.step = step
        self.k = k
        self.loss: float | torch.Tensor = math.nan
        self._host: list = []  # (name, numbers tuple, packed sketch or None), known now
        self._waiting: list = []  # (name, where its numbers arrive: numbers_of's pending)
        self._batch: HostBatch | None = None
        self._buckets: list = []  # DeviceBuckets holding this step's numbers
        #: does the step wait for a copy from an accelerator?
        self.on_device = False

    def extend(self, other: "PendingPrint") -> None:
        """Add another optimizer's tensors of the same step."""
        self._host.extend(other._host)
        self._waiting.extend(other._waiting)
        self._batch = self._batch or other._batch
        self._buckets.extend(other._buckets)
        self.on_device = self.on_device or other.on_device

    def resolve(self) -> tuple[float, list, np.ndarray, np.ndarray]:
        entries = list(self._host)
        if self._waiting:
            if self._batch is not None:
                self._batch.compute()  # every slot of the batch, other optimizers' too
            for bucket in self._buckets:
                bucket.resolve()  # one copy per device; the numbers were computed at take()
            resolve_device_stats([slot for _, slot in self._waiting])
            entries += [(name, *slot.result) for name, slot in self._waiting]
        k = self.k
        names = [name for name, _, _ in entries]
        numbers = np.array([entry[1] for entry in entries], dtype=np.float64).reshape(-1, 6)
        missing = _nan_sketch(k).tobytes()
        blob = b"".join(packed if packed is not None and len(packed) == 8 * k else missing
                        for _, _, packed in entries)
        loss = self.loss
        if isinstance(loss, torch.Tensor):
            loss = float(loss)
        return loss, names, numbers, np.frombuffer(blob, dtype=np.float64).reshape(-1, k)


def take(step: int, tensors: list[tuple[str, torch.Tensor]], k: int,
         batch: HostBatch | None = None) -> PendingPrint:
    """Statistics and sketches of ``tensors`` [(name, tensor)], without waiting for a device.
    ``batch``: the HostBatch CPU tensors go through (kept by the caller from step to step: its
    arenas and layouts are reused); None computes each CPU tensor at once."""
    pending = PendingPrint(step, k)
    on_cpu_too = device_path_on_cpu()
    if k <= 0:
        batch = None  # the batch computes sketches; without one, per tensor is as cheap
    bucket = DeviceBucket(k)
    for name, tensor in tensors:
        on_cpu = tensor.device.type == "cpu"
        numbers, sketched, slot = numbers_of(tensor, k, on_cpu_too or not on_cpu, batch, bucket)
        if slot is None:
            pending._host.append((name, numbers, sketched))
        else:
            pending._waiting.append((name, slot))
            pending.on_device = pending.on_device or not on_cpu
    if bucket.flush():  # computed now, before the next step writes the tensors
        pending._buckets.append(bucket)
    pending._batch = batch
    return pending


__all__ = ["take", "optimizer_tensors", "describe", "PendingPrint"]
