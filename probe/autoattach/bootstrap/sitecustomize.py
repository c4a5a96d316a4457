"""Loaded by Python at start-up in processes ``probe run -c`` starts (probe/autoattach).

Two jobs, both cheap and neither importing torch: load the sitecustomize this one shadows, and
attach probe once the program imports torch (with ``probe run --perturb``, $PROBE_PERTURB=1:
first enter probe.perturb's other-device rounding for the whole process) (a finder on sys.meta_path until torch has run: it lets
torch's own loader run, then calls probe.autoattach.session.attach()). A failure to attach is
one line on stderr; the program runs on without capture.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_shadowed_sitecustomize():
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


class _AttachAfterTorch:
    """A meta-path finder that only watches for ``torch``: it finds torch's spec the usual
    way, and makes that loader call attach() right after torch's module has run. It stays on
    sys.meta_path until torch has run: libraries look torch up without importing it
    (``importlib.util.find_spec("torch")`` in datasets and transformers), and the spec such a
    look-up gets is not the one the import later uses."""

    def __init__(self):
        self._looking = False  # inside our own look-up: let the other finders answer

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self._looking:
            return None
        self._looking = True
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            self._looking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run_torch = loader.exec_module
        finder = self

        def exec_module(module):
            try:
                run_torch(module)
            finally:
                del loader.exec_module  # the loader is torch's own again
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
            _attach()

        loader.exec_module = exec_module
        return spec


#: the other-device rounding mode ``probe run --perturb`` entered for the whole process
_PERTURB = []


def _attach():
    if os.environ.get("PROBE_PERTURB") == "1" and not _PERTURB:
        # entered first, so that the capture's own torch-function mode sits above it and
        # records each op once, as in a plain run (probe.perturb)
        from probe.perturb import OtherRounding

        mode = OtherRounding()
        mode.__enter__()
        _PERTURB.append(mode)
    if os.environ.get("PROBE_ATTACH") != "1" or not os.environ.get("PROBE_CONFIG"):
        return
    try:
        from probe.autoattach import session

        session.attach()
    except Exception as error:  # never break the user's program over the capture
        print(f"probe: automatic capture not attached: {type(error).__name__}: {error}",
              file=sys.stderr)


def _install():
    try:
        _load_shadowed_sitecustomize()
    except Exception as error:
        print(f"probe: the sitecustomize this run shadows failed: {error}", file=sys.stderr)
    attach = os.environ.get("PROBE_ATTACH") == "1" and os.environ.get("PROBE_CONFIG")
    if not attach and os.environ.get("PROBE_PERTURB") != "1":
        return
    if "torch" in sys.modules:
        _attach()
    else:
        sys.meta_path.insert(0, _AttachAfterTorch())


_install()
