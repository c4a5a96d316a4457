import os
import sys

# tests, bench and examples share examples/models.py
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
# the test files live in folders that mirror probe's packages (tests/compare, tests/capture,
# ...); the helpers they share (real_models, torch_versions, ...) stay in tests/ itself
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.append(TESTS)
