"""The prepared run for a lent GPU machine: what to measure there first, as one command.

A GPU is lent rarely and briefly (minutes, start-up included), so the checks that need one are
one script, rehearsed on the CPU, that writes each result to --out the moment it is known:
a run cut short by its time limit still leaves what it finished.

    python bench/device_check.py --out "$OUT"                       # on the GPU machine
    python bench/device_check.py --device cpu --out /tmp/check --only env,pairs   # rehearsal

Stages, in this order (--only picks some):

  env       env.txt: torch, CUDA, the device, probe's version, the load
  pairs     pairs.json (and a line per pair printed): a tiny GPT trained two steps on the CPU (A) and on the
            device (B, clean; C, one block's GELU switched to its tanh approximation), dumped
            at level mix as statistics and as tensors, and ``probe compare`` of A-B (must
            pass: the devices' rounding alone) and A-C (must be diverged, first at
            blocks.1.mlp.1). With --device cpu, B and C run under
            probe.perturb.other_rounding() (another device's reduction order, emulated) and
            take the accelerator's capture path (PROBE_DEVICE_PATH=1: the numbers computed
            from the device bucket, as on a GPU).
  overhead  overhead.txt and overhead.json: bench/dump_overhead.py --device cuda (--device
            cpu in a rehearsal), one model at a time in its own process, in the order of
            --models; a model is started only while the budget leaves room for it (this stage
            gets 65% of what is left when records follows), and the table is rewritten as each
            finishes. The msprobe columns appear where mindstudio-probe imports
            (docs/performance.md, "On a lent GPU", says how to carry its wheels).
  records   records.txt and records.json: bench/record_cost.py --device cuda, the host's time
            per captured record at levels mix, api and module (the device path, and the
            records alone) beside the floor of any capture in Python (--floor), one model at
            a time (--record-models), within what is left.

At most 8 files come back from a lent machine's output folder: these stages write at most 7
(errors.txt only on trouble), which leaves one for the log of what was printed.

Exit status: 0 when every stage that ran gave what it must (A-B pass, A-C diverged at the
planted block, every bench model measured), 1 when a check failed or a model was left out, 2
on trouble (a stage that could not run). The summary line of each stage is printed as it ends.
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

STAGES = ("env", "pairs", "overhead", "records")
#: each bench stage's models on each device, most wanted first (on the CPU: a rehearsal)
BENCH_MODELS = {"overhead": {"cuda": ("gpt2s", "gpt", "mlp", "deepmlp", "convnet", "gpt2s-bf16"),
                             "cpu": ("mlp",)},
                "records": {"cuda": ("gpt", "gpt2s"), "cpu": ("tiny",)}}
#: the share of the time left that the overhead stage may take when the records stage follows
OVERHEAD_SHARE = 0.65
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

    from bench.record_cost import device_path
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
    # emulated: the numbers are taken as a GPU's are, held in the device bucket and read at its
    # flushes, and the reductions summed in another order
    with device_path(True) if emulated else contextlib.nullcontext(), \
            other_rounding() if emulated else contextlib.nullcontext():
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
    _say(f"pairs: A on the CPU; B, C on {other}; C with {BUGGY_MODULE} GELU -> tanh approximation")
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
            if not ok:  # the dumps are gone with the machine: keep what compare said of them
                summary["report"] = result.to_dict()
            report["pairs"].append(summary)
            where = "" if first is None else f", first {first['key']} ({first['origin']})"
            line = (f"{task:10} {name:5} A-{other_side}: {summary['verdict']}{where}; "
                    f"{summary['differing']} of {summary['counts']['matched']} paired records differ, "
                    f"{summary['counts']['diverged']} diverged; "
                    f"{'OK' if ok else 'WRONG: wanted ' + wanted}")
            _say("pairs: " + line)
            _write(out, "pairs.json", json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


# ------------------------------------------------------------------------- overhead, records

#: stage -> (its bench script, the key of the script's JSON rows)
BENCHES = {"overhead": ("dump_overhead.py", "results"), "records": ("record_cost.py", "rows")}
#: arguments each stage's script always gets: the records stage times the floor of any capture
#: in Python beside probe's (bench/capture_floor.py), on the host that drives the GPU
STAGE_ARGS = {"overhead": (), "records": ("--floor",)}


def bench_command(stage: str, model: str, device: str, repeats: int, extra=()) -> list[str]:
    """The run of one model by a stage's bench script (its --json object on stdout); extra:
    more of the script's arguments."""
    script, _ = BENCHES[stage]
    return [sys.executable, os.path.join(REPO_ROOT, "bench", script), "--models", model,
            "--repeats", str(repeats), "--device", device, "--json", *STAGE_ARGS[stage], *extra]


def stage_bench(out: str, stage: str, device: str, models: list[str], repeats: int, deadline: float,
                extra=()) -> int:
    """Each model in its own process, most wanted first, while the deadline leaves room; the
    table and the JSON rewritten after each."""
    if stage == "overhead":
        from bench.dump_overhead import format_table
    else:
        from bench.record_cost import format_table
    rows_key = BENCHES[stage][1]
    rows, runs, skipped = [], [], []
    longest = 0.0
    code = 0
    for position, model in enumerate(models):
        left = deadline - time.monotonic()
        if left < max(30.0, 1.5 * longest):
            skipped.append(model)
            continue
        began = time.monotonic()
        try:
            done = subprocess.run(bench_command(stage, model, device, repeats, extra), cwd=REPO_ROOT,
                                  capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            _say(f"{stage}: {model} ran past the budget; stopped")
            skipped.extend(models[position:])
            code = 2
            break
        elapsed = time.monotonic() - began
        longest = max(longest, elapsed)
        if done.returncode != 0:
            _say(f"{stage}: {model} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
            _note_error(out, f"{stage} {model}", done.stderr)
            code = 2
            continue
        try:
            found = json.loads(done.stdout)
            rows.extend(found[rows_key])
        except (ValueError, KeyError) as error:  # printed something else: keep it, go on
            _say(f"{stage}: {model} printed no JSON rows ({error})")
            _note_error(out, f"{stage} {model}", done.stdout + done.stderr)
            code = 2
            continue
        runs.append({key: found[key] for key in found if key != rows_key} | {"model": model,
                                                                             "seconds": round(elapsed, 1)})
        _write(out, f"{stage}.json", json.dumps({"runs": runs, rows_key: rows}, indent=2) + "\n")
        _write(out, f"{stage}.txt", format_table(rows) + "\n")
        _say(f"{stage}: {model} measured in {elapsed:.0f} s")
    if rows:
        _say(f"{stage}:\n" + format_table(rows))
    if skipped:
        _say(f"{stage}: not measured (the budget ran out): {', '.join(skipped)}")
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
    for stage, flag in (("overhead", "--models"), ("records", "--record-models")):
        parser.add_argument(flag, default=None,
                            help=f"the {stage} stage's models, most wanted first (default: "
                                 + "; ".join(f"{d}: {','.join(m)}" for d, m in BENCH_MODELS[stage].items()) + ")")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per variant in the bench stages")
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"the pairs' dump tasks, of {', '.join(TASKS)}")
    parser.add_argument("--work", default=None,
                        help="folder for the pairs' dumps (default: a new temporary folder)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds this whole run may take; no bench model starts without room left")
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
    models = {stage: [m for m in (given.split(",") if given else BENCH_MODELS[stage][args.device]) if m]
              for stage, given in (("overhead", args.models), ("records", args.record_models))}
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
                until = deadline
                if stage == "overhead" and "records" in stages:
                    until = time.monotonic() + OVERHEAD_SHARE * (deadline - time.monotonic())
                found = stage_bench(args.out, stage, args.device, models[stage], args.repeats, until)
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
