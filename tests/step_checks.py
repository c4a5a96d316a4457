"""What the trainer-integration tests check in a dump: its steps, and the micro-batches of
each step file (forward calls of one module)."""

import probe


def assert_each_step_holds_micro_batches(path, steps: int, module: str, micro_batches: int):
    """The dump at ``path`` has steps 0 .. steps-1, and each step file holds forward calls
    0 .. micro_batches-1 of ``module``: one optimizer step, every micro-batch."""
    dump = probe.load(str(path))
    assert dump.steps == list(range(steps))
    for step in dump.steps:
        calls = {record["index"] for record in dump.records(step=step)
                 if record["kind"] == "module" and record["module"] == module
                 and record["phase"] == "forward"}
        assert calls == set(range(micro_batches)), (step, module, calls)
    return dump
