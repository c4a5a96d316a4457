"""The prepared run for a lent GPU machine: what to measure there first, as one command.

A GPU is lent rarely and briefly (minutes, start-up included), so the checks that need one are
one script, rehearsed on the CPU, that writes each result to --out the moment it is known:
a run cut short by its time limit still leaves what it finished.

    python bench/device_check.py --out "$OUT"                       # on the GPU machine
    python bench/device_check.py --device cpu --out /tmp/check --only env,pairs   # rehearsal

Stages, in this order (--only picks some):

  env       env.txt: torch, CUDA, the device, probe's version, the load
  pairs     pairs.txt and pairs.json: a tiny GPT trained two steps on the CPU (A) and on the
            device (B, clean; C, one block's GELU switched to its tanh approximation), dumped
            at level mix as statistics and as tensors, and ``probe compare`` of A-B (must
            pass: the devices' rounding alone) and A-C (must be diverged, first at
            blocks.1.mlp.1). With --device cpu, B and C run under
            probe.perturb.other_rounding(): another device's reduction order, emulated.
  overhead  overhead.txt and overhead.json: bench/dump_overhead.py --device cuda (--device
            cpu in a rehearsal), one model at a time in its own process, in the order of
            --models; a model is started only while --budget-s leaves room for it, and each
            one's table row is written as it finishes. The msprobe columns appear where
            mindstudio-probe imports (docs/performance.md, "On a lent GPU", says how to carry
            its wheels).

Exit status: 0 when every stage that ran gave what it must (A-B pass, A-C diverged at the
planted block, every overhead model measured), 1 when a check failed, 2 on trouble (a stage
that could not run). The summary line of each stage is printed as it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

STAGES = ("env", "pairs", "overhead")
#: the models of the overhead stage on each device, most wanted first
OVERHEAD_MODELS = {"cuda": ("gpt2s", "gpt", "mlp", "deepmlp", "convnet", "gpt2s-bf16"),
                   "cpu": ("mlp",)}
#: the planted bug of pair A-C and where compare must name it
BUGGY_MODULE = "blocks.1.mlp.1"
SIZES = {"vocab": 64, "d_model": 64, "n_heads": 4, "n_layers": 2, "max_len": 32}
BATCH = 4
SEED = 7
TASKS = ("statistics", "tensor")


def _write(out: str, name: str, text: str) -> str:
    path = os.path.join(out, name)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return path


def _say(line: str) -> None:
    print(line, flush=True)


def _note_error(out: str, what: str, text: str) -> None:
    """Every failure's whole text in one errors.txt (a lent machine returns at most 8 files)."""
    with open(os.path.join(out, "errors.txt"), "a", encoding="utf-8") as handle:
        handle.write(f"==== {what}\n{text}\n")


# ---------------------------------------------------------------------------------------- env


def stage_env(out: str, device: str) -> int:
    import torch

    import probe

    lines = [f"python {platform.python_version()} on {platform.machine()}",
             f"torch {torch.__version__} (CUDA {torch.version.cuda})", f"probe {probe.__version__}",
             f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f}"]
    if device == "cuda":
        if not torch.cuda.is_available():
            _write(out, "env.txt", "\n".join(lines + ["no CUDA device"]) + "\n")
            _say("env: torch sees no CUDA device")
            return 2
        props = torch.cuda.get_device_properties(0)
        lines.append(f"device {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                     f"{props.multi_processor_count} SMs, capability {props.major}.{props.minor}")
    _write(out, "env.txt", "\n".join(lines) + "\n")
    _say("env: " + "; ".join(lines))
    return 0


# -------------------------------------------------------------------------------------- pairs


def _train_and_dump(dump_dir: str, device: str, task: str, planted: bool, emulated: bool) -> None:
    """Two SGD steps of the tiny GPT from the same seed and weights, each step dumped."""
    import contextlib

    import torch
    from torch import nn

    from examples.models import TinyGPT, make_batch, train_step
    from probe import Config, PrecisionDebugger, seed_all
    from probe.perturb import other_rounding

    # seeds only: the runs keep each device's own kernels (TF32 is off by default for
    # float32 matmuls), so what differs between A and B is the devices' rounding
    seed_all(SEED)
    model = TinyGPT(**SIZES)
    if planted:
        model.blocks[1].mlp[1] = nn.GELU(approximate="tanh")
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = make_batch("gpt", BATCH, generator=torch.Generator().manual_seed(SEED), device=device,
                       **SIZES)
    debugger = PrecisionDebugger(Config(task=task, level="mix", dump_path=dump_dir, seed=SEED,
                                        overwrite=True, writer="inline"))
    with other_rounding() if emulated else contextlib.nullcontext():
        for _ in range(2):
            debugger.start(model)
            train_step(model, optimizer, *batch)
            debugger.stop()
            debugger.step()
    debugger.close()


def _differing(result) -> int:
    """Paired records whose values are not bit-identical: a clean pair must have many."""
    count = 0
    for row in result.to_dict(rows=True)["rows"]:
        metrics = row["metrics"] or {}
        if metrics.get("bit_equal") is False or (metrics.get("err_l2") or 0) > 0 \
                or (metrics.get("max_abs") or 0) > 0:
            count += 1
    return count


def _pair_summary(result, elapsed: float) -> dict:
    first = result.first_divergence
    return {"verdict": result.verdict, "counts": dict(result.counts), "differing": _differing(result),
            "compare_s": round(elapsed, 2),
            "first_divergence": None if first is None else {
                "key": first.key, "module": first.module, "origin": first.origin}}


def stage_pairs(out: str, device: str, work: str, tasks=TASKS) -> int:
    """A-B must pass, A-C must diverge first inside BUGGY_MODULE, for each task (dumps under
    work: a lent machine sends back only a few files of its output folder)."""
    from probe import compare

    emulated = device == "cpu"
    other = "the CPU under other_rounding()" if emulated else device
    report: dict = {"device": device, "emulated": emulated, "pairs": []}
    lines = [f"A: the CPU; B, C: {other}; C with {BUGGY_MODULE} GELU -> tanh approximation"]
    failed = False
    for task in tasks:
        root = os.path.join(work, task)
        began = time.perf_counter()
        _train_and_dump(os.path.join(root, "A"), "cpu", task, planted=False, emulated=False)
        _train_and_dump(os.path.join(root, "B"), device, task, planted=False, emulated=emulated)
        _train_and_dump(os.path.join(root, "C"), device, task, planted=True, emulated=emulated)
        trained = time.perf_counter() - began
        for name, other_side, wanted in (("clean", "B", "pass"), ("buggy", "C", "diverged")):
            began = time.perf_counter()
            result = compare(os.path.join(root, "A"), os.path.join(root, other_side))
            summary = _pair_summary(result, time.perf_counter() - began)
            first = summary["first_divergence"]
            if wanted == "pass":
                ok = summary["verdict"] == "pass"
            else:
                ok = summary["verdict"] == "diverged" and first is not None and (
                    first["module"] == BUGGY_MODULE or first["module"].startswith(BUGGY_MODULE + "."))
            failed = failed or not ok
            summary.update(task=task, pair=f"A-{other_side}", name=name, wanted=wanted, ok=ok,
                           train_and_dump_s=round(trained, 2))
            report["pairs"].append(summary)
            where = "" if first is None else f", first {first['key']} ({first['origin']})"
            line = (f"{task:10} {name:5} A-{other_side}: {summary['verdict']}{where}; "
                    f"{summary['differing']} of {summary['counts']['matched']} paired records differ, "
                    f"{summary['counts']['diverged']} diverged; "
                    f"{'OK' if ok else 'WRONG: wanted ' + wanted}")
            lines.append(line)
            _say("pairs: " + line)
            _write(out, "pairs.json", json.dumps(report, indent=2) + "\n")
    _write(out, "pairs.txt", "\n".join(lines) + "\n")
    return 1 if failed else 0


# ----------------------------------------------------------------------------------- overhead


def overhead_command(model: str, device: str, repeats: int) -> list[str]:
    """The bench/dump_overhead.py run of one model (its --json object on stdout)."""
    return [sys.executable, os.path.join(REPO_ROOT, "bench", "dump_overhead.py"), "--models", model,
            "--repeats", str(repeats), "--device", device, "--json"]


def stage_overhead(out: str, device: str, models: list[str], repeats: int, deadline: float) -> int:
    from bench.dump_overhead import format_table

    results, runs, skipped = [], [], []
    longest = 0.0
    code = 0
    for model in models:
        left = deadline - time.monotonic()
        if left < max(30.0, 1.5 * longest):
            skipped.append(model)
            continue
        began = time.monotonic()
        try:
            done = subprocess.run(overhead_command(model, device, repeats), cwd=REPO_ROOT,
                                  capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            _say(f"overhead: {model} ran past the budget; stopped")
            skipped.append(model)
            code = 2
            break
        elapsed = time.monotonic() - began
        longest = max(longest, elapsed)
        if done.returncode != 0:
            _say(f"overhead: {model} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
            _note_error(out, f"overhead {model}", done.stderr)
            code = 2
            continue
        found = json.loads(done.stdout)
        results.extend(found["results"])
        runs.append({key: found[key] for key in found if key != "results"} | {"model": model,
                                                                              "seconds": round(elapsed, 1)})
        _write(out, "overhead.json", json.dumps({"runs": runs, "results": results}, indent=2) + "\n")
        table = format_table(results)
        _write(out, "overhead.txt", table + "\n")
        _say(f"overhead: {model} measured in {elapsed:.0f} s")
    if results:
        _say("overhead:\n" + format_table(results))
    if skipped:
        _say(f"overhead: not measured (the budget ran out): {', '.join(skipped)}")
        code = code or 1
    return code


# --------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--out", required=True, help="folder for the results (created)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="the device under test (cpu: a rehearsal, other-device rounding emulated)")
    parser.add_argument("--only", default=",".join(STAGES),
                        help=f"comma-separated stages to run, of {', '.join(STAGES)}")
    parser.add_argument("--models", default=None,
                        help="overhead models, most wanted first (default: "
                             + "; ".join(f"{d}: {','.join(m)}" for d, m in OVERHEAD_MODELS.items()) + ")")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per variant in the overhead stage")
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"the pairs' dump tasks, of {', '.join(TASKS)}")
    parser.add_argument("--work", default=None,
                        help="folder for the pairs' dumps (default: a new temporary folder)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds this whole run may take; no overhead model starts without room left")
    args = parser.parse_args(argv)
    stages = [stage for stage in args.only.split(",") if stage]
    unknown = [stage for stage in stages if stage not in STAGES]
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    tasks = [task for task in args.tasks.split(",") if task]
    if not tasks or any(task not in TASKS for task in tasks):
        parser.error(f"--tasks {args.tasks!r}: choose from {', '.join(TASKS)}")
    deadline = time.monotonic() + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    models = [m for m in (args.models.split(",") if args.models else OVERHEAD_MODELS[args.device]) if m]
    code = 0
    for stage in STAGES:
        if stage not in stages:
            continue
        began = time.monotonic()
        try:
            if stage == "env":
                found = stage_env(args.out, args.device)
            elif stage == "pairs":
                with tempfile.TemporaryDirectory(prefix="probe-check-") as scratch:
                    found = stage_pairs(args.out, args.device, args.work or scratch, tasks)
            else:
                found = stage_overhead(args.out, args.device, models, args.repeats, deadline)
        except Exception as error:  # report it and go on: the next stage may still measure
            import traceback

            _note_error(args.out, stage, traceback.format_exc())
            _say(f"{stage}: trouble: {type(error).__name__}: {error}")
            found = 2
        _say(f"{stage}: done in {time.monotonic() - began:.0f} s, exit {found}")
        code = max(code, found)
        if stage == "env" and found:
            break  # no device: nothing else can be measured
    return code


if __name__ == "__main__":
    sys.exit(main())
