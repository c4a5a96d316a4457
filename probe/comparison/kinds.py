"""Where the tensor an input slot holds came from, and which kinds pass an error on.

The measure stage classifies each input (provenance.py); the judge stage adds *changed*,
*unpaired* and *forward* (explain.py); the attribute stage sizes what a call adds against
its carriers (attribute.summarize_call).
"""

from __future__ import annotations

from probe.comparison import result as R

#: input kinds (provenance.Provenance.kind, explain.judge_call): where the tensor an input slot holds came from
PRODUCED, PARAM_INPUT, PARAM_UPDATE, CARRIED, UNRECORDED, EXTERNAL, CHANGED = (
    "produced", "param", "param_update", "carried", "unrecorded", "external", "changed")
#: a produced input whose producing call has no partner in the other run
UNPAIRED = "unpaired"
#: a tensor record of the forward of the call whose backward is judged: the values the
#: backward computes from (saved activations, the weight the forward read)
FORWARD = "forward"
#: inputs that pass on an error made upstream, divergent or not; parameters and external
#: inputs carry their error too while within tolerance, and are sources once beyond it
CARRIERS = (PRODUCED, PARAM_UPDATE, CARRIED, UNRECORDED, FORWARD)


def is_carrier(kind: str, status: str) -> bool:
    return kind in CARRIERS or status != R.DIVERGED


def forward_carriers(forward: list[R.RecordRow]) -> list[R.RecordRow]:
    """The tensor records of a call's forward that its backward computes from: paired,
    measured as tensors (not plain values)."""
    return [r for r in forward if r.status in R.PAIRED and r.metrics is not None and r.metrics.evidence != "value"]
