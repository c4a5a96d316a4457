"""PrecisionDebugger and what it drives: its lifecycle (debugger.py), the step files it opens
and finishes (step_files.py), and what became of each file (write_results.py)."""

from probe.debugger.debugger import PrecisionDebugger

__all__ = ["PrecisionDebugger"]
