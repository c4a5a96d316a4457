"""A captured step raises the garbage collector's first threshold (capture/collector.py) and
leaves the program's thresholds as it found them, or as the program set them meanwhile."""

import gc
import types

import pytest
import torch
import torch.nn as nn

from probe.capture.collector import CAPTURE_THRESHOLD, PER_CALL, THRESHOLD_CAP, RelaxedCollector
from probe.config import Config
from probe.debugger.debugger import PrecisionDebugger


@pytest.fixture(autouse=True)
def _thresholds_as_they_were():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def _model_seeing_thresholds(seen: list):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model.register_forward_hook(lambda module, args, output: seen.append(gc.get_threshold()))
    return model


def _started_after_one_forward(tmp_path):
    """(debugger, model): Python's default thresholds, then start() and one forward."""
    gc.set_threshold(700, 10, 10)
    model = _model_seeing_thresholds([])
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    debugger.start(model)
    model(torch.randn(3, 4))
    return debugger, model


@pytest.mark.parametrize("level", ["api", "module", "mix"])
def test_a_captured_step_collects_less_often_and_step_puts_the_thresholds_back(tmp_path, level):
    gc.set_threshold(700, 10, 10)
    seen = []
    model = _model_seeing_thresholds(seen)
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level=level))
    with debugger.capture(model):
        model(torch.randn(3, 4)).sum().backward()
    model(torch.randn(3, 4))
    debugger.close()
    assert seen == [(CAPTURE_THRESHOLD, 10, 10), (700, 10, 10)]
    assert gc.get_threshold() == (700, 10, 10)


def test_the_higher_threshold_holds_until_step_hands_the_records_over_or_close(tmp_path):
    debugger, model = _started_after_one_forward(tmp_path)
    debugger.stop()
    between = gc.get_threshold()
    debugger.step()
    after_step = gc.get_threshold()
    debugger.start(model)
    model(torch.randn(3, 4))
    debugger.stop()
    debugger.close()  # the open step's file is written here
    assert (between, after_step, gc.get_threshold()) == ((CAPTURE_THRESHOLD, 10, 10), (700, 10, 10),
                                                         (700, 10, 10))


class _Chain(nn.Module):
    """A step of many calls: 3 API calls per link."""

    def __init__(self, links: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.links = links

    def forward(self, x):
        for _ in range(self.links):
            x = torch.tanh(x @ self.weight) * 0.5
        return x.sum()


def test_the_next_steps_threshold_grows_with_the_calls_a_captured_step_made(tmp_path):
    gc.set_threshold(700, 10, 10)
    seen = []
    model = _Chain(links=200)
    model.register_forward_hook(lambda module, args, output: seen.append(gc.get_threshold()[0]))
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    for _ in range(2):
        with debugger.capture(model):
            model(torch.randn(2, 4)).backward()
    debugger.close()
    calls = debugger.last_step_calls
    assert calls >= 600 and PER_CALL * calls > CAPTURE_THRESHOLD
    assert seen == [CAPTURE_THRESHOLD, PER_CALL * calls]
    assert gc.get_threshold() == (700, 10, 10)


def test_the_threshold_a_step_of_any_size_gets_is_capped():
    gc.set_threshold(700, 10, 10)
    collector = RelaxedCollector()
    collector.restore(calls=10**9)  # as after a step of a billion calls
    collector.relax()
    try:
        assert gc.get_threshold() == (THRESHOLD_CAP, 10, 10)
    finally:
        collector.restore()
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_the_program_sets_during_a_capture_stay_after_it(tmp_path):
    debugger, model = _started_after_one_forward(tmp_path)
    gc.set_threshold(1234, 5, 5)
    debugger.stop()
    debugger.step()
    debugger.close()
    assert gc.get_threshold() == (1234, 5, 5)


@pytest.mark.parametrize("thresholds", [(0, 10, 10), (CAPTURE_THRESHOLD * 4, 10, 10)],
                         ids=["collection-off", "already-higher"])
def test_a_threshold_that_is_off_or_already_higher_is_left_alone(tmp_path, thresholds):
    gc.set_threshold(*thresholds)
    seen = []
    model = _model_seeing_thresholds(seen)
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    with debugger.capture(model):
        model(torch.randn(3, 4))
    debugger.close()
    assert seen == [thresholds]
    assert gc.get_threshold() == thresholds


def test_an_exception_inside_a_capture_puts_the_thresholds_back(tmp_path):
    gc.set_threshold(700, 10, 10)
    model = _model_seeing_thresholds([])
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    with pytest.raises(ZeroDivisionError):
        with debugger.capture(model):
            model(torch.randn(3, 4))
            1 / 0
    debugger.close()
    assert gc.get_threshold() == (700, 10, 10)


def test_a_step_the_config_does_not_select_leaves_the_thresholds_alone(tmp_path):
    gc.set_threshold(700, 10, 10)
    seen = []
    model = _model_seeing_thresholds(seen)
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), step=[1]))
    with debugger.capture(model):  # step 0: not selected
        model(torch.randn(3, 4))
    debugger.close()
    assert seen == [(700, 10, 10)]


class _BrokenBuffers(nn.Linear):
    def named_buffers(self, *args, **kwargs):
        raise RuntimeError("no buffers today")


def test_a_start_that_fails_leaves_the_thresholds_as_they_were(tmp_path):
    gc.set_threshold(700, 10, 10)
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    with pytest.raises(RuntimeError, match="no buffers today"):
        debugger.start(_BrokenBuffers(4, 4))
    assert not debugger.started and gc.get_threshold() == (700, 10, 10)
    debugger.close()


def _made_by_probe(thing) -> bool:
    if isinstance(thing, types.FunctionType):
        return thing.__module__.startswith("probe")
    return type(thing).__module__.startswith("probe")


@pytest.mark.parametrize("level", ["api", "module", "mix"])
def test_a_captured_step_leaves_no_cycle_of_probes_for_the_collector_to_free(tmp_path, level):
    """What a step made is freed by reference counts when the step's file is handed over: the
    collector, asked less often while a step is captured, has nothing of probe's to find."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level=level))

    def captured_step():
        with debugger.capture(model):
            optimizer.zero_grad()
            model(torch.randn(3, 4)).pow(2).mean().backward()
            optimizer.step()

    captured_step()  # first-step caches, the writer process
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        captured_step()
        gc.collect()
        left = [thing for thing in gc.garbage if _made_by_probe(thing)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    debugger.close()
    assert left == []
