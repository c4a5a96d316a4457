"""Another device's rounding, on this one: the same math, reductions summed in another order.

Two correct runs on two devices differ because their kernels add in another order (split-K
matmuls, tree reductions, other conv algorithms), not because they compute something else.
``other_rounding()`` makes a run on this machine differ from a plain run in exactly that way,
so a compare of the two shows what rounding alone does, without a second device:

    from probe.perturb import other_rounding

    with other_rounding():          # enter it before PrecisionDebugger.start()
        train()

``probe run --perturb`` does the same for a whole command. Enter it before capture starts:
probe's torch-function mode then sits above it and records each op once, as in a plain run.
"""

from probe.perturb.reductions import OtherRounding, other_rounding

__all__ = ["OtherRounding", "other_rounding"]
