"""Which test modules pytest-xdist hands out first (tests/conftest.py sorts by it)."""

#: The test modules that take longest (CPU seconds of the module and the subprocesses it waits for,
#: `--cpu-durations`), heaviest first. pytest-xdist (--dist loadfile --no-loadscope-reorder)
#: hands whole modules to its processes in collection order: with these first and the
#: many short modules after them, no process is left running a long module alone at the end
#: (xdist's own order, most tests first, put the three-test trainer runs last). A module
#: missing here only runs later; list one when it grows past ~10 s.
HEAVIEST_FIRST = [
    "tests/capture/test_capture_plain_compiled.py",
    "tests/examples/test_examples.py",
    "tests/integrations/test_determinism_trainers.py",
    "tests/compare/test_envelope_verdicts.py",
    "tests/capture/test_sharded.py",
    "tests/compare/test_compare_scale.py",
    "tests/dump/test_crash_safety.py",
    "tests/analysis/test_determinism.py",
    "tests/fingerprint/test_fingerprint_runs.py",
    "tests/integrations/test_autoattach.py",
    "tests/integrations/test_integrations_hf_compiled.py",
    "tests/compare/test_drift_data.py",
    "tests/capture/test_capture_compiled_hf.py",
    "tests/integrations/test_integrations_hf_fsdp2.py",
    "tests/examples/test_examples_reproducibility.py",
    "tests/seed/test_seed.py",
    "tests/compare/test_real_models.py",
]
