"""The suite's own scheduling: the files named as the heaviest exist (a renamed file would
silently lose its place at the front and leave a long file to run alone at the end)."""

import os

from conftest import HEAVY_FIRST

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_file_scheduled_first_exists_and_is_named_once():
    missing = [path for path in HEAVY_FIRST if not os.path.isfile(os.path.join(REPO_ROOT, path))]
    assert not missing, missing
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)
