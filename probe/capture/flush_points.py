"""Where the device bucket is flushed besides a full bucket and a write the capture sees.

The bucket (numbers/device_bucket.py) reads its tensors when it flushes. A step's recorded
tensors are next written or freed at a few points, and the bucket is flushed there, all of it
in one batch: when a backward pass starts (the forward's tensors, before backward frees
them), when it ends (the gradients, before an optimizer or DDP's reducer writes them; the
autograd engine's end-of-backward callback) and before and after every optimizer step
(global optimizer step hooks): an optimizer updating its parameters in place then finds the
bucket empty, where a flush per written tensor would cost a batch's launches each. A flush
of an empty bucket costs nothing.
"""

from __future__ import annotations

import torch.optim.optimizer as _optimizer_hooks

from probe import compat

_graph_task_id = compat.graph_task_id


class FlushPoints:
    """The flush points of one recorder's bucket: ``backward_event()`` from each backward
    event, ``watch()`` / ``unwatch()`` around a capture (the optimizer hooks)."""

    def __init__(self, bucket) -> None:
        self.bucket = bucket
        self._task = -1  # the backward pass whose start flushed the bucket

    def backward_event(self) -> None:
        """A backward event: the first of a backward pass flushes the forward's tensors and
        asks for a flush when the pass ends."""
        task = _graph_task_id()
        if task == self._task:
            return
        self._task = task
        if task == -1:  # a hook run outside a backward pass
            return
        self.bucket.flush()
        compat.queue_backward_callback(self.bucket.flush)

    def watch(self) -> None:
        """Flush before and after every optimizer step (until unwatch)."""
        if self.bucket not in _WATCHED:
            _WATCHED.append(self.bucket)
        _install_optimizer_hooks()

    def unwatch(self) -> None:
        if self.bucket in _WATCHED:
            _WATCHED.remove(self.bucket)


#: the buckets flushed around every optimizer step. The optimizer hooks are installed once
#: and stay: a capture starts and stops from inside optimizer hooks (zero-edit capture ends a
#: step in its post hook), and torch iterates its hook dict while they run, so adding or
#: removing a hook there raises "OrderedDict mutated during iteration". With no bucket
#: watched a hook costs one check per optimizer step.
_WATCHED: list = []
_installed: list = []


def _install_optimizer_hooks() -> None:
    if _installed:
        return
    _installed.append((_optimizer_hooks.register_optimizer_step_pre_hook(_flush_watched),
                       _optimizer_hooks.register_optimizer_step_post_hook(_flush_watched)))


def _flush_watched(*_) -> None:
    for bucket in tuple(_WATCHED):
        if len(bucket):
            _outside_function_modes(bucket.flush)


def _outside_function_modes(work) -> None:
    """work() with no TorchFunctionMode active (an optimizer hook runs under the capture's
    mode, whose records must not include the bucket's own torch calls)."""
    modes = compat.function_mode_stack()
    for _ in modes:
        compat.pop_function_mode()
    try:
        work()
    finally:
        for mode in modes:
            compat.push_function_mode(mode)
