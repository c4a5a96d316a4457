"""Capture for training loops a framework owns: one step file per optimizer step.

* ``probe.integrations.hf.ProbeCallback(config)``: transformers ``Trainer`` (``pip install
  precision-probe[hf]``);
* ``probe.integrations.lightning.ProbeCallback(config)``: Lightning ``Trainer``
  (``precision-probe[lightning]``);
* ``probe.integrations.accelerate.AcceleratorCapture(accelerator, config)``: a loop written
  with accelerate (``precision-probe[accelerate]``).

Each module imports its framework; this package and ``import probe`` import none of them.
For a script with no probe code at all, see ``probe run -c`` (probe/autoattach).
"""
