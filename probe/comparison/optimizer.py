"""The optimizer step across implementations, and its records named by parameter.

On CUDA, torch's optimizers run their *foreach* implementation: one ``torch._foreach_*``
call over all parameters of a group (``_foreach_lerp_(exp_avgs, grads, 0.1)``); on a CPU they
loop over the parameters and call the per-tensor op for each (``exp_avg.lerp_(grad, 0.1)``).
The i-th tensor of a foreach call is the i-th parameter's, so:

* pair_foreach: when one run has foreach calls left without a partner and the other run has
  per-tensor calls left without one (same phase, same module), each foreach call is split
  into one *element* call per tensor (slots ``input.K.i`` -> ``input.K``, ``output.i`` ->
  ``output.0``, a list argument -> its i-th value, any other argument shared by every
  element). The elements of a *block* (the foreach calls of one parameter group) are laid
  out parameter by parameter, the order the per-tensor loop runs in, and aligned with the
  other run's calls on (op without its foreach/in-place spelling, shape), as align.py
  aligns any stream. A scalar argument spelled positionally on one side and by keyword on
  the other (``_foreach_addcdiv_(..., scalars)`` against ``addcdiv_(..., value=)``) pairs
  by position among the unpaired plain values.
* name_targets: every optimizer call (run after the backward began, outside any module) is
  named by the parameter it updates: a tensor it reads or writes is that parameter's
  ``param.*`` or ``param_grad.*`` record, or was made by an optimizer call already named;
  the elements of one foreach block share their position's name; a call linked to nothing
  takes the name of the next named call (a loop body starts with its step counter).

Fused kernels (``torch._fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``) update in place
and return nothing, so their records hold the inputs only: they are split into elements
too, named, and paired with a fused call on the other side; against an unfused run they
stay unpaired (counted, never a pass), as docs/compare.md says.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections import defaultdict

from probe.comparison.align import CallPair
from probe.comparison.records import Call, Records, is_param_slot

FOREACH_PREFIX = "torch._foreach_"
FUSED_PREFIX = "torch._fused_"
#: how a foreach element paired with a per-tensor call (CallPair.how)
FOREACH = "foreach"
_ELEMENT = re.compile(r"^(input|kwarg)\.([^.]+)\.(\d+)(.*)$")
_OUTPUT = re.compile(r"^output\.(\d+)$")
#: per-tensor spellings of a foreach op's base name (``_foreach_norm`` runs vector_norm)
_ALIASES = {"vector_norm": "norm", "true_divide": "div", "multiply": "mul", "subtract": "sub"}


def is_foreach(op: str) -> bool:
    return op.startswith((FOREACH_PREFIX, FUSED_PREFIX))


def base_op(op: str) -> str:
    """The op whatever its spelling: torch._foreach_add_, Tensor.add_, torch.add -> "add"."""
    name = op.removeprefix(FOREACH_PREFIX).rsplit(".", 1)[-1].rstrip("_")
    return _ALIASES.get(name, name)


# ------------------------------------------------------------------------------ splitting


def _elements(call: Call, records: Records) -> list[Call]:
    """A foreach call as one call per tensor of its lists (empty when it holds no list)."""
    cols = records.columns
    per_element: dict[int, dict[str, int]] = defaultdict(dict)
    shared: dict[str, int] = {}
    lists: dict[str, list] = {}
    for slot, row in call.slots.items():
        match = _ELEMENT.match(slot)
        out = _OUTPUT.match(slot)
        if match and cols["dtype"][row] != "":
            per_element[int(match.group(3))][f"{match.group(1)}.{match.group(2)}{match.group(4)}"] = row
        elif out and cols["dtype"][row] != "" and call.op.startswith(FOREACH_PREFIX):
            per_element[int(out.group(1))]["output.0"] = row
        else:
            shared[slot] = row
            value = _list_value(cols["value"][row]) if cols["dtype"][row] == "" else None
            if value is not None:
                lists[slot] = value
    count = len(per_element)
    if count == 0 or sorted(per_element) != list(range(count)):
        return []
    elements = []
    for i in range(count):
        slots = dict(per_element[i])
        common = set()
        for slot, row in shared.items():
            if slot in slots:
                continue
            values = lists.get(slot)
            if values is not None and len(values) == count:
                derived = records.row(row)
                derived["value"] = json.dumps(values[i])
                derived["key"] = f"{derived['key']}[{i}]"
                slots[slot] = records.append(derived)
            else:
                slots[slot] = row
                common.add(slot)
        first = min(slots.values())
        element = Call(
            module=call.module, op=call.op, index=call.index, phase=call.phase, kind=call.kind, seq=call.seq,
            first_row=first, slots=slots, name=call.name, element=i, shared=frozenset(common),
        )
        element.shapes = tuple(sorted((s, cols["shape"][r]) for s, r in slots.items() if cols["dtype"][r] != ""))
        elements.append(element)
    return elements


def split_foreach(calls: list[Call], records: Records) -> list[Call]:
    """Every foreach call replaced by its elements (in the call's place, element order)."""
    result: list[Call] = []
    for call in calls:
        elements = _elements(call, records) if is_foreach(call.op) else []
        result.extend(elements or [call])
    return result


def _list_value(text: str):
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, list) else None


def _signature(element: Call, records: Records) -> tuple:
    """(op, plain scalar arguments): the same signature twice means a new parameter group."""
    cols = records.columns
    scalars = tuple(sorted((slot, cols["value"][row]) for slot, row in element.slots.items()
                           if slot in element.shared and cols["dtype"][row] == ""))
    return element.op, scalars


def _calls_of(elements: list[Call]) -> list[list[Call]]:
    """Elements -> the foreach calls they came from (each its elements in order), in call order."""
    calls: dict = {}
    for element in elements:
        calls.setdefault((element.op, element.index), []).append(element)
    ordered = sorted(calls.values(), key=lambda group: group[0].order())
    return [sorted(group, key=lambda e: e.element) for group in ordered]


def _blocks(elements: list[Call], records: Records) -> list[list[list[Call]]]:
    """Foreach elements -> blocks (a parameter group's calls) -> each call's elements."""
    blocks: list[list[list[Call]]] = []
    seen: set = set()
    size = None
    for call in _calls_of(elements):
        if [e.element for e in call] != list(range(len(call))):
            continue  # some elements already paired: not a whole call
        signature = _signature(call[0], records)
        if not blocks or len(call) != size or signature in seen:
            blocks.append([])
            seen = set()
            size = len(call)
        seen.add(signature)
        blocks[-1].append(call)
    return blocks


def _parameter_major(block: list[list[Call]]) -> list[Call]:
    """The elements of a block in the per-tensor loop's order: every op of tensor 0, then 1..."""
    return [elements[i] for i in range(len(block[0])) for elements in block]


# ------------------------------------------------------------------------------ pairing


def _token(call: Call, records: Records) -> tuple:
    cols = records.columns
    row = call.slots.get("input.0", call.slots.get("output.0"))
    shape = cols["shape"][row] if row is not None else ""
    return base_op(call.name[1]), shape


def pair_foreach(pairs: list[CallPair], records_a: Records, records_b: Records) -> list[CallPair]:
    """Pair the foreach calls left without partner in one run with the per-tensor calls left
    without partner in the other (see the module docstring); every other pair is kept."""
    lonely_a = [p.a for p in pairs if p.b is None]
    lonely_b = [p.b for p in pairs if p.a is None]
    if not lonely_a or not lonely_b:
        return pairs
    fused = {id(c) for c in lonely_a + lonely_b if c.element >= 0}
    if not fused:
        return pairs
    new_pairs: list[CallPair] = []
    replaced: set = set()
    groups_a = _by_stream(lonely_a)
    groups_b = _by_stream(lonely_b)
    for stream in groups_a.keys() & groups_b.keys():
        calls_a, calls_b = groups_a[stream], groups_b[stream]
        foreach_a = [c for c in calls_a if id(c) in fused]
        foreach_b = [c for c in calls_b if id(c) in fused]
        if foreach_a and foreach_b:
            # both runs split their foreach calls; pair those left over only where the other
            # run has no foreach element left in this stream
            continue
        if foreach_a and not foreach_b:
            made = _pair_side(foreach_a, calls_b, records_a, records_b, a_is_foreach=True)
        elif foreach_b and not foreach_a:
            made = _pair_side(foreach_b, calls_a, records_b, records_a, a_is_foreach=False)
        else:
            continue
        if made is None:
            continue
        split, per_tensor, stream_pairs = made
        replaced |= split | per_tensor
        new_pairs += stream_pairs
    if not new_pairs:
        return pairs
    kept = [p for p in pairs if id(p.a if p.a is not None else p.b) not in replaced]
    return kept + new_pairs


def _by_stream(calls: list[Call]) -> dict:
    streams: dict = defaultdict(list)
    for call in calls:
        streams[(call.phase, call.name[0])].append(call)
    return streams


def _pair_side(foreach, others, records_f, records_o, a_is_foreach):
    """Elements of the foreach side's calls against the other side's per-tensor calls."""
    blocks = _blocks(foreach, records_f)
    elements = [element for block in blocks for element in _parameter_major(block)]
    if not elements:
        return None
    per_tensor = [c for c in others if c.element < 0]
    tokens_f = [_token(c, records_f) for c in elements]
    tokens_o = [_token(c, records_o) for c in per_tensor]
    matcher = difflib.SequenceMatcher(None, tokens_f, tokens_o, autojunk=False)
    partner: dict[int, Call] = {}
    for tag, f0, f1, o0, o1 in matcher.get_opcodes():
        if tag == "equal":
            for k in range(f1 - f0):
                partner[id(elements[f0 + k])] = per_tensor[o0 + k]
    if not partner:
        return None
    result: list[CallPair] = []
    for element in elements:
        other = partner.get(id(element))
        if other is not None:
            _name_leftover_values(element, other, records_f, records_o)
            pair = CallPair(element, other, FOREACH) if a_is_foreach else CallPair(other, element, FOREACH)
        else:
            if element.element > 0:
                # a lonely element keeps its own tensors; the call's shared arguments stay with element 0
                element.slots = {s: r for s, r in element.slots.items() if s not in element.shared}
            pair = CallPair(element, None) if a_is_foreach else CallPair(None, element)
        result.append(pair)
    paired_others = {id(c) for c in partner.values()}
    for call in per_tensor:
        if id(call) not in paired_others:
            result.append(CallPair(None, call) if a_is_foreach else CallPair(call, None))
    _order_pairs(result)
    return {id(e) for e in elements}, {id(c) for c in per_tensor}, result


def _name_leftover_values(element: Call, other: Call, records_f: Records, records_o: Records) -> None:
    """A scalar given positionally on one side and by keyword on the other: pair the unpaired
    plain values of the two calls by position (the element's slot takes the other's name)."""
    values_f = [s for s, r in element.slots.items() if records_f.columns["dtype"][r] == "" and s not in other.slots]
    values_o = [s for s, r in other.slots.items() if records_o.columns["dtype"][r] == "" and s not in element.slots]
    if not values_f or len(values_f) != len(values_o):
        return
    ordered_f = sorted(values_f, key=element.slots.get)
    ordered_o = sorted(values_o, key=other.slots.get)
    slots = dict(element.slots)
    for mine, theirs in zip(ordered_f, ordered_o):
        slots[theirs] = slots.pop(mine)
        if mine in element.shared:
            element.shared = (element.shared - {mine}) | {theirs}
    element.slots = slots


def _order_pairs(pairs: list[CallPair]) -> None:
    """Execution-order keys: A's own; a B-only call right after the pair before it."""
    known = [pair.a.order() for pair in pairs if pair.a is not None]
    anchor: tuple = min(known) if known else (-1, -1)
    following = 0
    for pair in pairs:
        if pair.a is not None:
            anchor = pair.a.order()
            following = 0
            pair.order = (*anchor, 0, pair.a.element + 1)
        else:
            following += 1
            pair.order = (*anchor, 1, following)


# ------------------------------------------------------------------------------ naming


def name_targets(calls: list[Call], records: Records) -> None:
    """Set Call.target on the optimizer calls of one run (module docstring: name_targets)."""
    cols = records.columns
    backward = [int(s) for s, phase in zip(cols["seq"], cols["phase"]) if phase == "backward"]
    if not backward:
        return
    start = min(backward)
    names = _parameter_prints(records)
    made: dict = defaultdict(set)  # fingerprint -> names of the optimizer calls that wrote it
    region = [c for c in calls if c.phase == "forward" and c.seq > start and c.kind == "api" and c.module == ""]
    for call in region:
        found = _linked(call, records, names, made)
        if len(found) == 1:
            call.target = next(iter(found))
            for slot, row in call.slots.items():
                if cols["io"][row] == "out" or slot == "input.0":
                    mark = _print(cols, row)
                    if mark is not None:
                        made[mark].add(call.target)
    _share_in_blocks(region)
    following = ""
    for call in reversed(region):
        if call.target:
            following = call.target
        elif following:
            call.target = following


def _linked(call: Call, records: Records, names: dict, made: dict) -> set:
    """The parameters a call's tensors tie it to: a tensor that is one parameter's value or
    gradient decides; else one written by an optimizer call named before; else what every
    linked tensor agrees on (all-zero state of equal shape matches many parameters)."""
    cols = records.columns
    direct, produced = [], []
    for row in call.slots.values():
        mark = _print(cols, row)
        if mark is None:
            continue
        if names.get(mark):
            direct.append(names[mark])
        if cols["io"][row] == "in" and made.get(mark):
            produced.append(made[mark])
    for found in (direct, produced):
        unique = set().union(*(names_ for names_ in found if len(names_) == 1))
        if len(unique) == 1:
            return unique
    linked = direct + produced
    common = set.intersection(*linked) if linked else set()
    return common if len(common) == 1 else set()


def _share_in_blocks(region: list[Call]) -> None:
    """The elements at one position of a foreach block are one parameter's: a position named
    by any of its elements names them all."""
    by_position: dict = defaultdict(list)
    for call in region:
        if call.element >= 0:
            by_position[call.element].append(call)
    for elements in by_position.values():
        named = {c.target for c in elements if c.target}
        if len(named) == 1:
            for call in elements:
                call.target = call.target or next(iter(named))


def _parameter_prints(records: Records) -> dict:
    """fingerprint -> names of the parameters whose value or gradient it is."""
    cols = records.columns
    names: dict = defaultdict(set)
    for row, slot in enumerate(cols["slot"]):
        if not (is_param_slot(slot) or slot.startswith("param_grad.")):
            continue
        mark = _print(cols, row)
        if mark is None:
            continue
        name = slot.split(".", 1)[1]
        module = cols["module"][row]
        names[mark].add(f"{module}.{name}" if module else name)
    return names


def _print(cols: dict, row: int):
    """A tensor's identity within one step file: its stored id, else its statistics."""
    if cols["dtype"][row] == "":
        return None
    if cols["tensor_id"][row] >= 0:
        return ("id", cols["tensor_id"][row])
    numbers = tuple(cols[name][row] for name in ("min", "max", "mean", "norm"))
    if all(math.isnan(value) for value in numbers) or cols["numel"][row] <= 1:
        return None  # a scalar (a step counter) says nothing about which parameter it is
    return ("stats", cols["dtype"][row], cols["shape"][row], *map(repr, numbers), cols["checksum"][row])


__all__ = ["split_foreach", "pair_foreach", "name_targets", "is_foreach", "base_op", "FOREACH"]
