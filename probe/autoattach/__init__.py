"""Zero-edit capture: ``probe run -c config.json -- python train.py`` (and ``probe determinism
-- python train.py``) on a script without probe code.

``probe run`` (``probe determinism`` alike) puts this package's ``bootstrap`` folder first on the child's PYTHONPATH and sets
$PROBE_ATTACH=1. Python imports ``sitecustomize`` from that folder when it starts (the same
mechanism ddtrace-run and coverage's subprocess support use): it loads the user's own
sitecustomize, if any, and waits for ``import torch``. When torch has been imported,
probe.autoattach.session builds a PrecisionDebugger from $PROBE_CONFIG and registers torch's
global module and optimizer hooks (session.py says what they do). Nothing of torch is
replaced or wrapped.

Why a start-up hook and not ``python -m probe.autoattach train.py``: it works whatever the
command is (``python``, ``torchrun``, ``accelerate launch``, a shell script) and reaches every
process of the run, each rank included.

This module does not import torch (``probe run`` imports it).
"""

from __future__ import annotations

import os

#: "1": the child attaches (set by ``probe run -c``); "0" in the caller's environment: never
ENV_ATTACH = "PROBE_ATTACH"
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def attach_env(env: dict[str, str], model_class: str | None = None) -> dict[str, str]:
    """``env`` plus what makes a Python child attach: the bootstrap folder first on
    PYTHONPATH and PROBE_ATTACH=1, and PROBE_MODEL=``model_class`` when one is named (the
    model's class, choose_model.py). Unchanged when ``env`` says PROBE_ATTACH=0 (opt-out)."""
    if env.get(ENV_ATTACH) == "0":
        return env
    env = _with_bootstrap(env, ENV_ATTACH)
    if model_class:
        env[ENV_MODEL] = model_class
    return env


#: the class of the module to take as the model (``--model CLASS``; choose_model.py)
ENV_MODEL = "PROBE_MODEL"


def _with_bootstrap(env: dict[str, str], flag: str) -> dict[str, str]:
    """``env`` with the bootstrap folder first on PYTHONPATH (once) and ``flag``=1."""
    env = dict(env)
    rest = [part for part in env.get("PYTHONPATH", "").split(os.pathsep)
            if part and os.path.abspath(part) != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *rest])
    env[flag] = "1"
    return env


#: "1": the child computes with another device's rounding (``probe run --perturb``)
ENV_PERTURB = "PROBE_PERTURB"


def perturb_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus what makes a Python child enter probe.perturb.other_rounding() for the
    whole process once it imports torch: the bootstrap folder on PYTHONPATH and PROBE_PERTURB=1."""
    return _with_bootstrap(env, ENV_PERTURB)


def wanted(environ=None) -> bool:
    """True in a process ``probe run`` asked to attach (PROBE_ATTACH=1 and a config)."""
    environ = os.environ if environ is None else environ
    return environ.get(ENV_ATTACH) == "1" and bool(environ.get("PROBE_CONFIG"))
