import gc
import os
import sys

import pytest

# One intra-op thread per test process unless the caller asks for more: the models here are
# tiny, the suite runs in parallel processes (pytest-xdist, one per core), and idle OpenMP
# threads spinning against the other processes cost a fifth of the suite's CPU time. Tests
# that compare thread counts set them themselves (torch.set_num_threads); subprocesses inherit
# the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Triton reads TRITON_INTERPRET once, when it is imported (torch's compile stack may import
# it first): the suite runs on CPUs, where the device bucket's Triton kernel runs in Triton's
# interpreter (tests/capture/test_bucket_kernel.py), so the variable is set before anything.
os.environ.setdefault("TRITON_INTERPRET", "1")

# tests, bench and examples share examples/models.py
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
# the test files live in folders that mirror probe's packages (tests/compare, tests/capture,
# ...); the helpers they share (real_models, torch_versions, ...) stay in tests/ itself
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.append(TESTS)

import process_state  # noqa: E402  (found through TESTS, just added to sys.path)
from suite_schedule import HEAVIEST_FIRST  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _library_logs_in_the_tests_temporary_folder(tmp_path_factory):
    """stable-baselines3 makes a log folder for every learn() (an empty /tmp/SB3-<time> unless
    SB3_LOGDIR says where): under pytest's own temporary folder, the suite leaves none behind
    (subprocesses inherit the variable)."""
    if "SB3_LOGDIR" not in os.environ:
        os.environ["SB3_LOGDIR"] = str(tmp_path_factory.mktemp("sb3-logs"))


@pytest.fixture(scope="module", autouse=True)
def _module_isolated():
    """Each test module starts from the process state the session started with, whatever
    module ran before it in this process: the tests run in parallel processes
    (pytest-xdist, --dist loadfile), each running its own share of the modules in its own
    order. Within a module, tests run in file order, as they always have.

    What earlier modules left alive (imported libraries, dynamo's caches, compiled graphs) is
    frozen out of the garbage collector's sight once its garbage is collected: every full
    collection a test triggers would walk it all again, and the pytest process holds more
    than any user's training process does (the quick dump_overhead benchmark run in this
    process took 33 CPU-s after the compiled-trainer tests without the freeze, 2 with it)."""
    gc.collect()
    gc.freeze()
    state = process_state.save()
    yield
    process_state.restore(state)

def pytest_collection_modifyitems(config, items):
    rank = {path: number for number, path in enumerate(HEAVIEST_FIRST)}
    last = len(rank)
    # a stable sort: within a module, and among the modules not listed, the order stays
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], last))


# --cpu-durations=N: the N tests that used the most CPU time, their own process's and that of
# the subprocesses they waited for (torchrun jobs, examples). Wall-clock --durations moves with
# the machine's load; CPU time does not, so this is the list to read on a shared machine.
def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests that used the most CPU time (subprocesses included)")


def _cpu_seconds():
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    spent = getattr(item, "_cpu_spent", None)
    if spent is not None and call.when in spent:
        outcome.get_result().user_properties.append(("cpu_seconds", spent[call.when]))


def _measured(phase):
    @pytest.hookimpl(hookwrapper=True)
    def hook(item, *args):
        start = _cpu_seconds()
        yield
        item.__dict__.setdefault("_cpu_spent", {})[phase] = _cpu_seconds() - start
    return hook


pytest_runtest_setup = _measured("setup")
pytest_runtest_call = _measured("call")
pytest_runtest_teardown = _measured("teardown")

_CPU_BY_TEST: dict = {}


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == "cpu_seconds":
            _CPU_BY_TEST[report.nodeid] = _CPU_BY_TEST.get(report.nodeid, 0.0) + value


def pytest_terminal_summary(terminalreporter, config):
    count = config.getoption("--cpu-durations")
    if count is None or not _CPU_BY_TEST:
        return
    ranked = sorted(_CPU_BY_TEST.items(), key=lambda pair: pair[1], reverse=True)
    terminalreporter.write_sep("=", f"{count or len(ranked)} tests using the most CPU time "
                                    f"(all tests: {sum(_CPU_BY_TEST.values()):.1f} s)")
    for nodeid, seconds in ranked[:count or None]:
        terminalreporter.write_line(f"{seconds:8.2f}s cpu  {nodeid}")
