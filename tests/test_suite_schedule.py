"""The suite's own schedule: the modules tests/conftest.py hands out first exist."""

import os

from suite_schedule import HEAVIEST_FIRST

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_module_listed_as_heaviest_first_exists_once():
    missing = [path for path in HEAVIEST_FIRST if not os.path.isfile(os.path.join(REPO_ROOT, path))]
    assert not missing, f"renamed or removed: {missing}; update HEAVIEST_FIRST in tests/suite_schedule.py"
    assert len(set(HEAVIEST_FIRST)) == len(HEAVIEST_FIRST)
