"""Fingerprints: a few numbers per tensor and per optimizer step, to find where two long runs
part without dumping every step (docs/fingerprints.md).

    capture side (torch):   take.py (statistics + sketch of each tensor), recorder.py (the
                            optimizer-step hook), session.py (inside a PrecisionDebugger)
    file (h5py):            schema.py (the layout), file.py (append-only writer, readers)
    compare side (no torch): envelope.py (what rounding allows), compare.py (first step,
                            jump or drift), live.py (step by step against a reference),
                            report.py (text, JSON, HTML)

This package imports nothing itself: ``probe compare`` loads the compare side without torch.
"""
