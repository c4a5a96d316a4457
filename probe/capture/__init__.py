"""Capture: what a PrecisionDebugger installs to record a step, in three wings and a recorder.

* ``eager/`` sees eager calls: module hooks (module_hooks.py), the API-level TorchFunctionMode
  (api_mode.py, api_backward.py, backward_collectives.py), how a call is named, filtered and
  described (naming.py, filters.py, values.py, defaults.py, autocast.py, placement.py,
  wrappers.py), which calls write tensors in place (write_watch.py), and how hooks and mode
  stay out of compiled code (compiled_regions.py,
  compiled_functions.py);
* ``compiled/`` sees inside compiled graphs: a dynamo backend that taps a graph's values
  (graph_taps.py) and gradients (grad_taps.py), named as the eager run names the same calls
  (graph_names.py, graph_marks.py, graph_events.py), and gives a plain torch.compile's
  regions those taps while a capture runs them (region_taps.py);
* ``numbers/`` turns tensors into statistics and sketches: per tensor (stats.py, sketch.py),
  a CPU batch at a time (host_batch.py, host_view.py), a device bucket at a time, read by the
  host once per step (device_bucket.py), per DTensor shard (shard_sketch.py); route.py decides
  which of them a tensor takes (``numbers_of``, for the recorder and for fingerprints);
* ``recorder.py`` makes the records both wings hand it, with the numbers of numbers/;
  flush_points.py says where its device bucket is flushed (backward's start and end, around
  optimizer steps); collector.py keeps Python's garbage collector from rescanning the records
  while a step is captured.

The names below are what the debugger, the replay, fingerprints, the integrations and
``probe.compile`` use; code outside capture imports them from here, never from a wing
(tests/test_architecture.py).
"""

from probe.capture.recorder import Recorder
from probe.capture.collector import RelaxedCollector
from probe.capture.eager.api_mode import ApiCaptureMode
from probe.capture.eager.autocast import autocast_dtype
from probe.capture.eager.compiled_regions import Gate
from probe.capture.eager.compiled_regions import targets as region_targets
from probe.capture.eager.defaults import bound_values
from probe.capture.eager.filters import CaptureFilter
from probe.capture.eager.module_hooks import ModuleHooks
from probe.capture.eager.write_watch import WriteWatchMode
from probe.capture.eager.values import SourceLocator, flatten
from probe.capture.eager.wrappers import unwrap, user_modules
from probe.capture.numbers.host_batch import HostBatch
from probe.capture.numbers.device_bucket import DeviceBucket, device_path_on_cpu
from probe.capture.numbers.route import numbers_of, resolve_device_stats
from probe.capture.numbers.sketch import DEFAULT_SIZE as SKETCH_SIZE
from probe.capture.numbers.stats import dtype_name
from probe.capture.compiled.graph_taps import activate as activate_graph_taps
from probe.capture.compiled.graph_taps import compile
from probe.capture.compiled.graph_taps import deactivate as deactivate_graph_taps
from probe.capture.compiled.region_taps import RegionTaps

__all__ = [
    "Recorder", "RelaxedCollector", "ApiCaptureMode", "ModuleHooks", "Gate", "user_modules",
    "activate_graph_taps", "deactivate_graph_taps", "compile", "CaptureFilter", "HostBatch",
    "SourceLocator", "flatten",
    "bound_values", "DeviceBucket", "WriteWatchMode", "device_path_on_cpu", "RegionTaps",
    "region_targets", "numbers_of", "resolve_device_stats", "SKETCH_SIZE", "dtype_name", "unwrap", "autocast_dtype",
]
