"""tests/capture/test_capture_values.py again with PROBE_DEVICE_PATH=1 (tests/device_path.py)."""

from device_path import rerun_on_the_device_path

rerun_on_the_device_path("test_capture_values", globals())
