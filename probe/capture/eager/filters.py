"""Which records a capture keeps: the scope, list and data_mode keys of the Config.

The step and rank keys are applied by the debugger before anything is installed (an
unselected step costs one comparison). The rest is decided here, once per (module, op)
pair and cached, so a filtered-out call costs a dict lookup:

* scope: module-path prefixes on dot boundaries (Config.in_scope). An API call is in scope
  when its innermost module is; a module or parameter record when its own module is.
* list: an entry equal to the op name selects the whole call; otherwise entries are checked
  against each record key (substring, or ``re:`` regex search), see Config.matches_list.
* data_mode: forward/backward select phases, input/output select directions (io "in"/"out").
"""

from __future__ import annotations

from probe.config import Config

#: call decisions
SKIP = 0  # record nothing for this call
ALL = 1  # every record of the call
BY_KEY = 2  # test each record's key against the list


class CaptureFilter:
    __slots__ = ("config", "decisions", "_has_list", "forward_in", "forward_out", "backward_in",
                 "backward_out", "forward", "backward")

    def __init__(self, config: Config) -> None:
        self.config = config
        self.decisions: dict[tuple[str, str], int] = {}
        self._has_list = bool(config.list)
        self.forward_in = config.wants_data("forward", "in")
        self.forward_out = config.wants_data("forward", "out")
        self.backward_in = config.wants_data("backward", "in")
        self.backward_out = config.wants_data("backward", "out")
        self.forward = self.forward_in or self.forward_out
        self.backward = self.backward_in or self.backward_out

    def call(self, module: str, op: str) -> int:
        """SKIP, ALL or BY_KEY for a call of op inside module (cached)."""
        key = (module, op)
        decision = self.decisions.get(key)
        if decision is None:
            decision = self.decisions[key] = self._decide(module, op)
        return decision

    def _decide(self, module: str, op: str) -> int:
        config = self.config
        if not config.in_scope(module):
            return SKIP
        if not self._has_list or config.matches_list(op):
            return ALL
        return BY_KEY

    def key_wanted(self, op: str, key: str) -> bool:
        return self.config.matches_list(op, key)

    def wants(self, phase: str, io: str) -> bool:
        if phase == "forward":
            return self.forward_in if io == "in" else self.forward_out
        return self.backward_in if io == "in" else self.backward_out
