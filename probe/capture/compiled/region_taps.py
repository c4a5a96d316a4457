"""Graph taps for a plain ``torch.compile``: the user's compiled regions, compiled once more.

A model compiled with ``torch.compile(model)``, ``model.blocks[i] = torch.compile(block)``,
``block.compile()`` or ``@torch.compile`` functions records only at its regions' boundaries:
probe adds nothing inside compiled code. While a capture at level api or mix is on, each
region instead runs through graph taps (graph_taps.TapBackend) wrapped around the backend
the user compiled it with:

* each compiled callable (an OptimizedModule's ``forward``, a module's
  ``_compiled_call_impl``, a compiled function) evaluates its frames with a dynamo callback
  held in its closure; start() sets that to a callback compiling with
  ``TapBackend(user's backend)`` (the user's mode and options are part of that backend;
  fullgraph is kept), and stop() puts the user's own back;
* the user's graphs stay in dynamo's cache beside the tapped ones, each found by its own
  guards (the backend is one of them): the first captured step compiles the tapped graphs,
  later captured steps reuse them, and the steps between run the user's compiled code
  without a recompile;
* one TapBackend per user backend, so blocks compiled one by one still share one graph;
* the submodules of a region get probe's graph marks (argument names inside the graph,
  graph_marks.py) for the captured steps only.

Each region's graphs are thus cached twice: a region that already needs more than half of
dynamo's recompile limit keeps its boundary records only, so no capture makes dynamo give up
on it. A torch whose dynamo does not inline torch.nn modules (2.4) keeps boundary records.
"""

from __future__ import annotations

import warnings
import weakref

from probe import compat
from probe.capture.compiled import graph_marks
from probe.capture.compiled.graph_taps import TapBackend
from probe.capture.eager import compiled_functions, compiled_regions

#: (the user's backend, TapBackend wrapping it, {fullgraph: dynamo callback}); looked up by
#: equality: torch.compile makes a new, equal, backend wrapper for every call
_tapped: list = []
_TAPPED_LIMIT = 64
_warned = False


def _callback(backend, fullgraph: bool):
    """The dynamo callback compiling with TapBackend(backend), the same one every time."""
    for known, tap, callbacks in _tapped:
        try:
            same = known is backend or known == backend
        except Exception:  # a backend whose __eq__ refuses another type
            same = False
        if same:
            break
    else:
        tap, callbacks = TapBackend(backend), {}
        del _tapped[:-_TAPPED_LIMIT]  # a process compiling with ever new backends: the oldest go
        _tapped.append((backend, tap, callbacks))
    callback = callbacks.get(fullgraph)
    if callback is None:
        callback = callbacks[fullgraph] = compat.dynamo_callback(tap, fullgraph)
    return callback


def _compiled_callables(model, targets) -> list:
    """(compiled callable, module whose submodules it traces or None, the function whose code
    dynamo caches its graphs on) of each region."""
    found = []
    for target in targets:
        if not target.region:
            continue
        forward = type(target.module).forward
        if target.compiled_call:
            found.append((compat.compiled_call(target.module), target.module, forward))
        elif target.hook_on is not None:
            own = vars(target.hook_on)  # OptimizedModule: forward (lazy modules: _forward)
            found.append((own.get("_forward", own.get("forward")), target.module, forward))
        else:  # compiled functions of the instance (Lightning's training_step and forward)
            found.extend((function, target.module, compat.dynamo_original(function))
                         for function in compiled_functions.compiled_methods(target.module,
                                                                             target.held))
    found.extend((function, None, compat.dynamo_original(function)) for function in
                 compiled_functions.functions(model, [target.module for target in targets],
                                              compiled_regions.held_functions(targets)))
    return found


class RegionTaps:
    """The swapped callbacks and marks of one start(), until remove()."""

    def __init__(self) -> None:
        self._swapped: list = []  # (cell, the user's callback)
        self._marked: list = []

    def install(self, model, targets) -> None:
        if model is None or not compat.dynamo_inlines_nn_modules():
            return
        global _warned
        try:
            for function, region, owner in _compiled_callables(model, targets):
                try:
                    self._tap(function, region, owner)
                except Exception as error:  # never fail the user's start() over the taps
                    if not _warned:
                        _warned = True
                        warnings.warn(f"probe: cannot give a compiled region graph taps "
                                      f"({error!r}); it is recorded at its boundary",
                                      RuntimeWarning, stacklevel=4)
        except BaseException:
            self.remove()
            raise

    def _tap(self, function, region, owner) -> None:
        found = compat.dynamo_callback_cell(function)
        if found is None:
            return
        cell, fullgraph = found
        original = cell.cell_contents
        if any(isinstance(link, TapBackend) for link in compat.dynamo_backend_links(original)) \
                or any(cell is mine for mine, _ in self._swapped):
            return  # probe.compile'd already, or a callable reached twice
        if not _room_for_taps(function, owner):
            return
        cell.cell_contents = _callback(compat.dynamo_backend(original), fullgraph)
        self._swapped.append((cell, original))
        if region is not None:
            self._marked.extend(graph_marks.add(region))

    def remove(self) -> None:
        swapped, self._swapped = self._swapped, []
        for cell, original in swapped:
            cell.cell_contents = original
        marked, self._marked = self._marked, []
        graph_marks.remove(marked)


#: compiled callable -> whether its graphs fit twice within the recompile limit: decided at
#: its first captured step, from the user's graphs alone, and kept
_room: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _room_for_taps(function, owner) -> bool:
    """Whether the tapped graphs fit beside the user's within dynamo's recompile limit: both
    sets are cached on the same code, ``owner``'s (the region's forward, the function)."""
    known = _room.get(function)
    if known is None:
        entries = compat.dynamo_cache_entries(getattr(owner, "__code__", None))
        limit = compat.dynamo_recompile_limit()
        known = entries is None or limit is None or 2 * max(entries, 1) <= limit
        try:
            _room[function] = known
        except TypeError:  # not weakly referable: decided again next time
            pass
    return known


__all__ = ["RegionTaps"]
