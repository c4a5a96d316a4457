"""bench/record_cost.py (host time per record) and bench/building_blocks.py run and say what
docs/performance.md quotes them for."""

import contextlib
import io
import json

import pytest
import torch

from bench import building_blocks, record_cost
from tests.torch_versions import litgpt_or_skip, transformers_or_skip


def _rows(*arguments) -> list[dict]:
    return _report(*arguments)["rows"]


def _report(*arguments) -> dict:
    """record_cost.py's JSON for the tiny GPT, one timed step a variant (torch's thread
    count, which the script sets to 1, restored after)."""
    out = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out):
            assert record_cost.main(["--models", "tiny", *arguments, "--repeats", "1", "--writer", "inline",
                                     "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(out.getvalue())


def test_record_cost_prints_microseconds_per_record_for_every_path():
    rows = _rows("--levels", "api", "--paths", "device,records")
    assert {(row["level"], row["path"]) for row in rows} == {("api", "device"), ("api", "records")}
    numbers = {(row["level"], row["path"]): row["numbers_ms"] for row in rows}
    for row in rows:
        assert row["records"] > 0 and row["us_per_record"] == row["us_per_record"]
        # start(), stop() and step() take some of the captured step, never all of it
        assert 0 < row["fixed_ms"] < row["captured_ms"]
        assert row["in_step_us_per_record"] == row["in_step_us_per_record"]
        # the garbage collections inside the timed step, a part of it
        assert 0 <= row["gc_ms"] < row["captured_ms"]
        # only the device path computes numbers in the bucket's flushes
        level = row["level"]
        assert numbers[level, "device"] > numbers[level, "records"]


def test_gc_threshold_times_the_capture_under_another_threshold_and_puts_probes_back():
    """--gc-threshold 700 measures the capture with Python's own first threshold (what the
    garbage collector costs without capture/collector.py); the run leaves probe's in place."""
    from probe.capture import collector

    chosen = (collector.CAPTURE_THRESHOLD, collector.PER_CALL)
    report = _report("--levels", "api", "--paths", "records", "--gc-threshold", "700")
    assert report["gc_threshold"] == 700 and report["rows"][0]["gc_ms"] >= 0
    assert (collector.CAPTURE_THRESHOLD, collector.PER_CALL) == chosen
    assert _report("--levels", "api", "--paths", "records")["gc_threshold"] is None  # probe's own


def test_the_floor_rows_count_every_levels_tensors_and_gradients():
    """--floor adds bench/capture_floor.py's row per level: its records are the step's tensors
    and gradients under their calls' names, so its us/record is a per-record cost like probe's."""
    rows = {(row["level"], row["path"]): row for row in _rows("--levels", "api,module", "--paths", "records",
                                                               "--floor")}
    assert set(rows) == {("api", "records"), ("module", "records"), ("api", "floor"), ("module", "floor")}
    for level in ("api", "module"):
        floor, probe_row = rows[level, "floor"], rows[level, "records"]
        assert floor["numbers_ms"] == 0 and 0 < floor["fixed_ms"] < floor["captured_ms"]
        # tensors only (no keyword defaults, scalars or grad_input of module calls)
        assert 0 < floor["records"] < probe_row["records"]
        assert floor["us_per_record"] == floor["us_per_record"]


@pytest.mark.parametrize("key", sorted(record_cost.LIBRARIES))
def test_a_real_librarys_workload_trains_its_model_one_step(key):
    """--models llama,litgpt: the library's own model, built from a config, and one step of a
    user's loop (its loss, backward, SGD) that moves every parameter it trains."""
    if key == "llama":
        transformers_or_skip()  # the suite's one reason for each torch where transformers cannot run
    else:
        litgpt_or_skip()
    _, sizes, batch = record_cost.MODELS[key]
    torch.manual_seed(0)
    model, train = record_cost._library_workload(key, sizes, batch, "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    train()
    moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
    assert len(moved) > 10 and all(moved)


@pytest.mark.parametrize("device, models", [("cpu", ["gpt", "gpt2s-t16"]), ("cuda", ["gpt", "gpt2s"])])
def test_the_default_models_are_the_gpt_and_a_gpt2_small_shape_short_enough_to_measure(device, models):
    """On a CPU GPT-2 small at T 128 takes 1.2 s a step and the capture's tens of milliseconds
    vanish in its spread: the default there is its layers at T 16 (the same calls)."""
    assert record_cost.parse_args(["--device", device])[1] == models
    shape = {key: value for key, value in record_cost.MODELS["gpt2s"][1].items() if key != "max_len"}
    short = record_cost.MODELS["gpt2s-t16"][1]
    assert {key: value for key, value in short.items() if key != "max_len"} == shape and short["max_len"] == 16


def _floor_records(level):
    import examples.models as models
    from bench.capture_floor import floor_capture

    torch.manual_seed(0)
    sizes = {"vocab": 32, "d_model": 16, "n_layers": 1, "max_len": 8}
    model = models.TinyGPT(n_heads=2, **sizes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = models.make_batch("gpt", 1, generator=torch.Generator().manual_seed(0), **sizes)
    with floor_capture(model, level) as records:
        models.train_step(model, optimizer, *batch)
    kept = len(records)
    models.train_step(model, optimizer, *batch)  # after the capture: nothing is recorded
    assert len(records) == kept
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    return {(call[0], call[1], slot) for call, slot, _ in records}


@pytest.mark.parametrize("level", ["api", "module", "mix"])
def test_the_floor_keeps_forward_and_backward_records_under_module_paths_and_unhooks(level):
    from torch.nn.modules import module as module_hooks

    slots = _floor_records(level)
    if level in ("api", "mix"):
        assert ("blocks.0.attn.qkv", "functional.linear", "output.0") in slots
        assert ("blocks.0.attn.qkv", "functional.linear", "grad_output.0") in slots
        # grad_input where the call is one autograd node (a linear over 3-d input is several)
        assert ("blocks.0.ln1", "functional.layer_norm", "grad_input.0") in slots
    if level in ("module", "mix"):
        assert ("blocks.0.attn.qkv", "Linear", "param.weight") in slots
        assert ("blocks.0.attn.qkv", "Linear", "grad_output.0") in slots
        assert ("blocks.0.attn.qkv", "param", "param.weight") in slots  # its gradient
    else:
        assert not any(op == "Linear" for _, op, _ in slots)
    # every hook goes with the capture (_floor_records ran a step after it, which recorded nothing)
    assert not module_hooks._global_forward_pre_hooks and not module_hooks._global_forward_hooks


def test_every_building_block_runs_and_agrees_with_float64_without_reading_the_host():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert building_blocks.main([]) == 0
    rows = [line.split("|")[1:-1] for line in out.getvalue().splitlines()[2:] if line.startswith("| ")]
    assert len(rows) == len(building_blocks.blocks(None))
    for name, ops, reads, error in ([cell.strip() for cell in row] for row in rows):
        assert reads == "0", name
        if error != "-":
            assert float(error) <= 1e-12, (name, error)
