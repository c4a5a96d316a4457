"""A compare runs its stages once each, in order (docs/architecture.md): watched with
sys.setprofile on a real pair of dumps (one training step on a GPU and on its host CPU,
foreach optimizer against per-parameter loops)."""

import os
import sys

from probe.comparison.api import compare
from test_architecture import COMPARE_STAGES

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "gpu_dumps")
#: the stages a record passes through, in order; support modules and the orchestrator
#: (api) are left out: every stage uses the first, the second calls the stages
STAGES = [(name, modules) for name, modules in COMPARE_STAGES if name not in ("support", "orchestration")]
STAGE_OF = {f"probe.comparison.{module}": number for number, (_, modules) in enumerate(STAGES)
            for module in modules}


def _stages_entered(run) -> list[str]:
    """The stages whose functions were called while run() ran, in order, each entry a new
    stage (consecutive calls into one stage are one entry). A generator resumed is not a
    new call: load.open_step_files hands over one pair of step files per resumption."""
    entered: list[int] = []

    def watch(frame, event, arg):
        if event != "call":
            return
        stage = STAGE_OF.get(frame.f_globals.get("__name__"))
        if stage is None or frame.f_lasti >= 0 and frame.f_code.co_flags & 0x20:  # CO_GENERATOR resumed
            return
        if not entered or entered[-1] != stage:
            entered.append(stage)

    sys.setprofile(watch)
    try:
        run()
    finally:
        sys.setprofile(None)
    return [STAGES[number][0] for number in entered]


def test_a_compare_visits_each_stage_once_in_pipeline_order():
    entered = _stages_entered(lambda: compare(os.path.join(DATA, "gpt_cpu"), os.path.join(DATA, "gpt_gpu")))
    assert entered == [name for name, _ in STAGES], entered
