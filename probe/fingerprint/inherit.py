"""Which jumps a step inherits from what it read (torch-free).

A tensor's gap that grows by more than GROWTH in one step is a jump only when what made the
tensor was still the same in both runs. A training step computes its tensors in order, and
each reads the ones before:

* a **gradient** is computed from the weights of the step before and the step's data. Once
  some weight has left its rounding envelope, the two runs' forwards read other weights, and
  then other data too where the model makes its own data (a policy samples other actions, a
  generator other tokens). A gradient then moves by steps rounding cannot bound: a decision
  that flips (a PPO ratio crosses its clip bound, a sample's action differs, a ReLU changes
  side) moves one sample's share of the batch at once. Measured on PPO against another
  device's rounding: gradients grew 2-500 times their recent gap in one step once the weights
  had parted, the largest where the rollouts sampled other actions.
* an **optimizer state** (Adam's exp_avg, exp_avg_sq) is computed from its parameter's
  gradient of the same step: it inherits from a gradient that is outside its envelope.
* a **parameter** is updated from its gradient and state: it inherits from a gradient or
  state that jumped in the same step. A parameter that jumps while its gradient and state
  did not (a weight scaled by a bug, an optimizer that adds something of its own) is a jump.

A NaN or Inf count that differs is never inherited: a run that turns non-finite is always
said. Before the weights part (every step of two runs that agree, and step 0 always) nothing
is inherited, so a changed formula (an eps, an activation) still jumps where it first acts.
"""

from __future__ import annotations

import numpy as np


def weights_outside(kinds: list, outside: np.ndarray) -> np.ndarray:
    """Per step (outside is steps x tensors), whether some parameter is outside its envelope."""
    weights = np.array([kind == "param" for kind in kinds], dtype=bool)
    if not weights.any():
        return np.zeros(outside.shape[0], dtype=bool)
    return outside[:, weights].any(axis=1)


def parted_before(kinds: list, outside: np.ndarray) -> np.ndarray:
    """Per step, whether some parameter had left its envelope at an earlier step: what that
    step's forward and backward read already differed."""
    parted = np.logical_or.accumulate(weights_outside(kinds, outside))
    return np.concatenate([[False], parted[:-1]])


def inherited(kinds: list, params: list, outside: np.ndarray, jumped: np.ndarray, nonfinite: np.ndarray,
              before: np.ndarray) -> np.ndarray:
    """Steps x tensors: the jumps that are inherited from what made the tensor (module doc).
    ``kinds``/``params``: each tensor's kind ("param", "grad", "state") and the parameter it
    belongs to; ``outside``/``jumped``/``nonfinite``: the raw envelope flags, steps x tensors;
    ``before``: per step, parted_before."""
    out = np.zeros_like(jumped, dtype=bool)
    grads = {param: column for column, (kind, param) in enumerate(zip(kinds, params)) if kind == "grad"}
    states: dict = {}
    for column, (kind, param) in enumerate(zip(kinds, params)):
        if kind == "state":
            states.setdefault(param, []).append(column)
    for column, (kind, param) in enumerate(zip(kinds, params)):
        if kind == "grad":
            out[:, column] = before
        elif kind == "state" and param in grads:
            out[:, column] = outside[:, grads[param]]
        elif kind == "param":
            sources = ([grads[param]] if param in grads else []) + states.get(param, [])
            if sources:
                out[:, column] = jumped[:, sources].any(axis=1)
    return out & jumped & ~nonfinite


__all__ = ["weights_outside", "parted_before", "inherited"]
