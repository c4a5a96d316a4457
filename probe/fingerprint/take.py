"""Taking one step's fingerprint: statistics and the sketch of every parameter, gradient
and optimizer-state tensor (torch; never h5py).

The numbers are capture's own (capture/numbers/: stats.py, sketch.py, device_bucket.py),
so a fingerprint's sketch and a step file's sketch of the same tensor are the same numbers.

* CPU float32/float64 tensors: capture's ``host_batch.HostBatch``, as capture records them.
  A tensor of at most SMALL_MAX values is copied into the batch's arena (one numpy copy) and
  computed with all the others when the step is written: a fixed number of numpy and torch
  calls per step instead of about ten per tensor, which on a small model's tensors (biases,
  norms) cost several times their arithmetic. A larger tensor's statistics are computed at
  once (``stats.host_stats_and_later_sketch``: each pass over values still in the cache) and
  only its sketch's fold goes to the arena. Other dtypes: ``stats.host_stats_and_sketch``
  per tensor. A batched small tensor's mean and norm are summed per row of BLOCK values,
  then in float64: the same numbers up to rounding (host_batch.py).
* Accelerator tensors (and CPU tensors with PROBE_DEVICE_PATH=1, for the tests): one
  ``device_bucket.DeviceBucket`` for the step, flushed at once (a fixed number of launches
  per device and dtype, however many tensors, computed before the next step writes them);
  its one copy to the host is made when the step is written, which the recorder does at the
  next step's end (or at close()), by when the device has long finished: nothing waits for
  the device inside the step.

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

from probe.capture.numbers import device_bucket, stats
from probe.capture.numbers.host_batch import HostBatch
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
    (loss, names, numbers (tensors, 6), sketches (tensors, k))."""

    def __init__(self, step: int, k: int) -> None:
        self.step = step
        self.k = k
        self.loss: float | torch.Tensor = math.nan
        self._host: list = []  # (name, numbers tuple, packed sketch or None), known now
        self._batched: list = []  # (name, HostSlot): CPU tensors, filled by their HostBatch
        self._batch: HostBatch | None = None
        self._buckets: list = []  # (DeviceBucket, [(name, slot)], holds accelerator tensors?)

    @property
    def on_device(self) -> bool:
        """Does the step wait for a copy from an accelerator?"""
        return any(accelerator for _, _, accelerator in self._buckets)

    def extend(self, other: "PendingPrint") -> None:
        """Add another optimizer's tensors of the same step."""
        self._host.extend(other._host)
        self._batched.extend(other._batched)
        self._batch = self._batch or other._batch
        self._buckets.extend(other._buckets)

    def resolve(self) -> tuple[float, list, np.ndarray, np.ndarray]:
        entries = list(self._host)
        if self._batched:
            self._batch.compute()  # every slot of the batch, other optimizers' too
            entries += [(name, *slot.result) for name, slot in self._batched]
        for bucket, slots, _ in self._buckets:
            bucket.resolve()  # one copy per device; the numbers were computed at take()
            entries += [(name, *slot.result) for name, slot in slots]
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
    on_cpu_too = device_bucket.device_path_on_cpu()
    bucket, slots, accelerator = None, [], False
    if k <= 0:
        batch = None  # the batch computes sketches; without one, per tensor is as cheap
    for name, tensor in tensors:
        if tensor.numel() == 0:
            pending._host.append((name, stats.EMPTY_STATS, None))
        elif tensor.device.type == "cpu" and not on_cpu_too:
            _take_on_host(pending, name, tensor, k, batch)
        elif tensor.dtype not in device_bucket.DTYPES:
            values, counts = stats.device_stats(tensor, k)  # complex, float8: one by one
            numbers, packed = stats.resolve_device_stats([(values, counts, tensor.numel())])[0]
            pending._host.append((name, numbers, packed))
        else:
            if bucket is None:
                bucket = device_bucket.DeviceBucket(k)
            slots.append((name, bucket.add(tensor.detach())))
            accelerator = accelerator or tensor.device.type != "cpu"
    if bucket is not None:
        bucket.flush()  # the numbers are computed now, before the next step writes the tensors
        pending._buckets.append((bucket, slots, accelerator))
    return pending


def _take_on_host(pending: PendingPrint, name: str, tensor: torch.Tensor, k: int,
                  batch: HostBatch | None) -> None:
    """A CPU tensor's numbers: through the batch (a HostSlot, filled at resolve) where it
    takes the tensor, else computed now."""
    if batch is None:
        pending._host.append((name, *stats.host_stats_and_sketch(tensor, k)))
        return
    numbers, sketched, slot = batch.take(tensor.detach() if tensor.requires_grad else tensor)
    if slot is None:
        pending._host.append((name, numbers, sketched))
        return
    pending._batched.append((name, slot))
    pending._batch = batch


__all__ = ["take", "optimizer_tensors", "describe", "PendingPrint"]
