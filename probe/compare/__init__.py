"""Compare two dumps: align calls, measure errors, judge, find the first divergence.

``probe.compare(a, b, **options)`` is probe.compare.api.compare. Because ``probe.compare``
is also the name of this package (once any of its modules is imported, the attribute on
``probe`` is the package), the package itself is callable and forwards to that function,
so ``probe.compare(a, b)`` works in either case. Importing this package imports nothing
heavy: no numpy, no h5py, never torch.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, a, b, **options):
        from probe.compare.api import compare

        return compare(a, b, **options)


def __getattr__(name):
    if name == "compare":
        from probe.compare.api import compare

        return compare
    raise AttributeError(f"module 'probe.compare' has no attribute {name!r}")


sys.modules[__name__].__class__ = _CallablePackage
