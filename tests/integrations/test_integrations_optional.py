"""The trainer frameworks stay optional: probe, probe.integrations and the zero-edit start-up
hook import none of them, and the hook imports no torch in a program that does not."""

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "accelerate")


def _python(code, *prefix, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE_")}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([*prefix, sys.executable, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_probe_and_its_integrations_package_imports_no_trainer_framework():
    loaded = _python("import sys, probe, probe.integrations, probe.integrations.core, "
                     "probe.autoattach, probe.debugger.debugger; "
                     f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])")
    assert loaded.strip() == "[]"


def test_the_zero_edit_start_up_hook_imports_no_torch_into_a_program_without_it(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"dump_path": "dump"}))
    printed = _python("import os, sys; print(os.environ['PROBE_ATTACH'], 'torch' in sys.modules)",
                      sys.executable, "-m", "probe", "run", "-q", "-c", "cfg.json", "--",
                      cwd=tmp_path)
    assert printed.split() == ["1", "False"]
