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
#: how a fused kernel's element paired with the last call of a per-parameter chain
FUSED = "fused"
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
        elif out and cols["dtype"][row] != "":
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
    for number, block in enumerate(_blocks([c for c in result if c.element >= 0], records)):
        for elements in block:
            for element in elements:
                element.block = number
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
    fused_pairs = _pair_fused(elements, per_tensor, partner, records_o)
    if not partner and not fused_pairs:
        return None
    result: list[CallPair] = []
    for element in elements:
        other = partner.get(id(element))
        if id(element) in fused_pairs:
            result += _fused_pair(element, fused_pairs[id(element)], records_f, records_o, a_is_foreach)
            continue
        if other is not None:
            _name_leftover_values(element, other, records_f, records_o)
            pair = CallPair(element, other, FOREACH) if a_is_foreach else CallPair(other, element, FOREACH)
        else:
            if element.element > 0:
                # a lonely element keeps its own tensors; the call's shared arguments stay with element 0
                element.slots = {s: r for s, r in element.slots.items() if s not in element.shared}
            pair = CallPair(element, None) if a_is_foreach else CallPair(None, element)
        result.append(pair)
    paired_others = {id(c) for c in partner.values()} | {id(c) for body in fused_pairs.values() for c in body}
    for call in per_tensor:
        if id(call) not in paired_others:
            result.append(CallPair(None, call) if a_is_foreach else CallPair(call, None))
    _order_pairs(result)
    return {id(e) for e in elements}, {id(c) for c in per_tensor}, result


def _pair_fused(elements, per_tensor, partner, records_o: Records) -> dict:
    """A fused kernel's element (torch._fused_adamw_'s i-th parameter) against the unfused
    run's loop body for the i-th parameter: the records allow comparing the updated
    parameter, the output of the body's last call. The loop runs the same ops for every
    parameter, so its calls (creation ops such as the step counter's torch.tensor aside) fall
    into equal bodies, one per element, in the fused list's order."""
    fused = [e for e in elements if e.op.startswith(FUSED_PREFIX) and id(e) not in partner and "output.0" in e.slots]
    if not fused:
        return {}
    taken = {id(c) for c in partner.values()}
    cols = records_o.columns
    loop = [c for c in per_tensor if id(c) not in taken and any(
        slot.startswith("input.") and cols["dtype"][row] != "" for slot, row in c.slots.items())]
    if not loop or len(loop) % len(fused):
        return {}
    size = len(loop) // len(fused)
    bodies = [loop[i * size:(i + 1) * size] for i in range(len(fused))]
    pattern = [base_op(c.op) for c in bodies[0]]
    if any([base_op(c.op) for c in body] != pattern for body in bodies) or "output.0" not in bodies[0][-1].slots:
        return {}
    found = {}
    for element, body in zip(fused, bodies):
        last = body[-1]
        if cols["shape"][last.slots["output.0"]] == cols["shape"][last.slots.get("input.0", last.slots["output.0"])]:
            found[id(element)] = body
    return found


def _fused_pair(element: Call, body: list[Call], records_f: Records, records_o: Records,
                a_is_foreach: bool) -> list[CallPair]:
    """One pair: the updated parameter (the element's output.0, the body's last output.0) and
    each tensor the fused kernel reads (parameter, gradient, optimizer state) against the
    body's first read of the most similar tensor of that shape (the loop reads each before
    writing it). What is left of both sides has no counterpart."""
    cols_f, cols_o = records_f.columns, records_o.columns
    last = body[-1]
    mine = {"output.0": element.slots["output.0"]}
    theirs = {"output.0": last.slots["output.0"]}
    used = {last.slots["output.0"]}
    # what the body reads from outside itself (the parameter, its gradient, the optimizer
    # state), each tensor at its first read; reads of what the body itself wrote are not
    written, reads = set(), []
    for call in body:
        for slot, row in sorted(call.slots.items(), key=lambda item: item[1]):
            mark = _print(cols_o, row)
            if cols_o["io"][row] == "in" and cols_o["dtype"][row] != "" and mark not in written:
                reads.append(row)
                written.add(mark)  # a later read of the same tensor is not a new one
        written |= {_print(cols_o, row) for row in call.slots.values() if cols_o["io"][row] == "out"}
    wanted = [(slot, row) for slot, row in element.slots.items()
              if cols_f["io"][row] == "in" and cols_f["dtype"][row] != "" and slot not in element.shared]
    # one read per input, the closest by statistics first (a parameter, its gradient and the
    # two moments differ in scale and sign far more than two runs do)
    options = sorted((_distance(cols_f, row, cols_o, other), slot, row, other)
                     for slot, row in wanted for other in reads if cols_o["shape"][other] == cols_f["shape"][row])
    for _, slot, row, other in options:
        if slot in mine or other in used:
            continue
        mine[slot], theirs[slot] = row, other
        used.add(other)
    pieces_f = [(_piece(element, mine), _piece(element, {s: r for s, r in element.slots.items()
                                                          if s not in mine and (element.element <= 0 or s not in element.shared)}))]
    pair_f, rest_f = pieces_f[0]
    pair_o = _piece(last, theirs)
    pairs = [CallPair(pair_f, pair_o, FUSED) if a_is_foreach else CallPair(pair_o, pair_f, FUSED)]
    leftovers = [rest_f] if rest_f is not None else []
    for call in body:
        rest = _piece(call, {s: r for s, r in call.slots.items() if r not in used})
        if rest is not None:
            pairs.append(CallPair(None, rest) if a_is_foreach else CallPair(rest, None))
    for rest in leftovers:
        pairs.append(CallPair(rest, None) if a_is_foreach else CallPair(None, rest))
    return pairs


def _distance(cols_f, row_f, cols_o, row_o) -> float:
    """How far apart two runs' records of one tensor are, by their statistics."""
    total = 0.0
    for name in ("norm", "mean", "max", "min"):
        x, y = cols_f[name][row_f], cols_o[name][row_o]
        if math.isnan(x) or math.isnan(y):
            continue
        total += abs(x - y) / max(abs(x), abs(y), 1e-30)
    return total


def _piece(call: Call, slots: dict) -> Call | None:
    """The call restricted to some of its slots (rows of other calls allowed: a virtual call)."""
    if not slots:
        return None
    piece = Call(module=call.module, op=call.op, index=call.index, phase=call.phase, kind=call.kind,
                 seq=call.seq, first_row=min(slots.values()), slots=slots, name=call.name,
                 element=call.element, target=call.target)
    piece.shapes = call.shapes
    return piece


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
    decisive: dict[int, str] = {}  # id(call) -> name, for calls a parameter's value or gradient names
    for call in region:
        found, direct = _linked(call, records, names, made)
        if len(found) == 1:
            call.target = next(iter(found))
            if direct:
                decisive[id(call)] = call.target
            for slot, row in call.slots.items():
                if cols["io"][row] == "out" or slot == "input.0":
                    mark = _print(cols, row)
                    if mark is not None:
                        made[mark].add(call.target)
    _vote_in_bodies([c for c in region if c.element < 0], records, decisive)
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
    for found, decides in ((direct, True), (produced, False)):
        unique = set().union(*(names_ for names_ in found if len(names_) == 1))
        if len(unique) == 1:
            return unique, decides
    linked = direct + produced
    common = set.intersection(*linked) if linked else set()
    return (common if len(common) == 1 else set()), False


def _vote_in_bodies(calls: list[Call], records: Records, decisive: dict) -> None:
    """A per-parameter loop runs the same ops for every parameter: split its calls (creation
    ops aside) into equal bodies and name each body by the parameter most of its decisively
    linked calls name (all-zero or all-one tensors of equal shape link to many parameters,
    and a wrong guess must not spread)."""
    cols = records.columns
    loop = [c for c in calls if any(s.startswith("input.") and cols["dtype"][r] != "" for s, r in c.slots.items())]
    while len(loop) >= 4:
        bodies = _trailing_bodies(loop)
        if not bodies:
            return
        _vote(bodies, decisive)
        loop = loop[:len(loop) - sum(len(body) for body in bodies)]


def _trailing_bodies(loop: list[Call]) -> list[list[Call]]:
    """The longest run of equal bodies (same ops in the same order) that ends the loop."""
    ops = [base_op(c.op) for c in loop]
    best: list = []
    for size in range(1, min(len(loop) // 2, 64) + 1):
        pattern = ops[len(ops) - size:]
        count = 0
        while (count + 1) * size <= len(ops) and ops[len(ops) - (count + 1) * size:len(ops) - count * size] == pattern:
            count += 1
        if count >= 2 and count * size > sum(len(b) for b in best):
            best = [loop[len(loop) - (k + 1) * size:len(loop) - k * size] for k in reversed(range(count))]
    return best


def _vote(bodies, decisive: dict) -> None:
    for body in bodies:
        votes: dict[str, int] = defaultdict(int)
        for call in body:
            if id(call) in decisive:
                votes[decisive[id(call)]] += 1
        if votes:
            best = max(votes.values())
            winners = [name for name, count in votes.items() if count == best]
            if len(winners) == 1:
                for call in body:
                    call.target = winners[0]


def _share_in_blocks(region: list[Call]) -> None:
    """The elements at one position of a foreach block (a parameter group) are one parameter's:
    a position named by any of its elements names them all."""
    by_position: dict = defaultdict(list)
    for call in region:
        if call.element >= 0:
            by_position[(call.block, call.element)].append(call)
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
