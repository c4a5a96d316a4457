"""What capturing costs a training step: the table docs/performance.md quotes.

    python bench/dump_overhead.py                       # all four models, 15 repeats
    python bench/dump_overhead.py --models mlp,convnet --repeats 20
    python bench/dump_overhead.py --quick               # smoke run: 2 small models, 5 repeats
    python bench/dump_overhead.py --sketch-only         # baseline, stats api with/without sketch
    python bench/dump_overhead.py --device cuda         # on a GPU: also CUDA kernels per step
    pip install mindstudio-probe==26.2.0 && python bench/dump_overhead.py   # with msprobe columns

One training step = forward + cross-entropy + backward + SGD step (lr 0.01, torch's default
per-parameter loop on CPU), examples.models.train_step. A captured step also includes
start(), stop() and step(), i.e. writing the step's HDF5 file.

Every variant runs in this one process with torch.set_num_threads(1). Variants are
interleaved in short blocks of consecutive steps (4 for steps under 50 ms, else 2), in a
new random order every round, so drift and other processes' load hit all variants alike and
no variant always follows the same one; the first
step of each block is not timed, because it pays for what the previous variant left behind
(cold caches, freed memory), and a gc.collect() before each block keeps one variant's
garbage from being collected in another one's steps. Each number is the median of at least --repeats timed steps
after two warm-up steps per variant. Ratios are variant / baseline.

Columns:
  baseline ms        median step time without probe
  not started        a PrecisionDebugger was constructed (seed_all ran) and never started
  unselected         start()/stop()/step() on steps the config's step list excludes
  stats api/module/mix   task statistics at each level (with the default sketch, k = 16)
  no sketch          stats api with sketch_size 0
  sketch cost        stats api / no sketch: what the sketches add to a captured step
  sketch share       time inside sketch.array_sketch, sketch.fold_into and
                     host_batch._arena_sketches (the sketches' numpy parts; it once timed
                     host_sketch, which also converted the tensor) over the rest of
                     a stats api step (CPU):
                     the same cost measured inside one step, so it is far less sensitive to
                     other processes' load than the ratio of two medians
  tensor api         task tensor at level api (every distinct tensor stored once)
  (no write)         stats api without step(), i.e. without writing the HDF5 file
  calls/step         API calls captured per step (statistics, api)
  ops plain/api      torch operators (aten::, nested ones included) dispatched in one plain step
                     and in one stats api step (start to step()), counted by torch.profiler in
                     an untimed step; ops ratio = api / plain
  kernels plain/api  with --device cuda: CUDA kernels (and copies) of the same two steps
  syncs api          with --device cuda: host synchronisations between start() and stop() of
                     one stats api step (torch.cuda.set_sync_debug_mode("warn"), warnings
                     counted); the device path's target is 0
  sync error mode    with --device cuda: "pass" when a captured step runs between start() and
                     stop() under torch.cuda.set_sync_debug_mode("error")
  launches plain/api aten ops that launch a kernel, of a plain and of a stats api step
                     (bench/launch_count.py: views, empty and metadata ops left out); allowed:
                     1.25 x plain + 30, the device path's target
  records            records of one stats api step
  host us/record     (stats api - baseline) / records in the training thread's CPU time: on a
                     GPU, the host's cost per record (on the CPU it includes the arithmetic)
  msprobe L1/L0      where mindstudio-probe is installed (else "-"): msprobe's statistics dump
                     at API level (L1) and module level (L0), every step, the same step
                     boundaries, timed in the same rounds (bench/msprobe_variants.py says how
                     it is kept from touching the other variants); --no-msprobe leaves it out
  ops msprobe L1     torch operators of one msprobe L1 step, counted like ops api (with
                     --device cuda also its CUDA kernels: kernels msprobe L1)
  us/call            (stats api - baseline) / calls; (no write): the same without step()
  dump/distinct      tensor-mode step file size / bytes of the distinct tensors it stores

Targets (docs/performance.md): on the CPU stats api <= 2x on mlp, <= 1.2x on convnet, <= 1.3x on
deepmlp, <= 1.05x on gpt, each beside msprobe; on a GPU a GPT-2-small-size step <= 1.5x,
every model at most half of msprobe's ratio, launches <= 1.25 x plain + 30, sync error mode
"pass"; not started <= 1.02x. Prints the table; --json prints one object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import msprobe_variants  # noqa: E402  (needs REPO on the path)

_GPT2S = {"d_model": 768, "n_heads": 12, "n_layers": 12, "max_len": 512}

MODELS = {
    # name: (constructor name, batch size, label, constructor and batch sizes, autocast dtype)
    "mlp": ("MLP", 32, "MLP 256-512-10 (batch 32)", {}, None),
    "convnet": ("SmallConvNet", 32, "SmallConvNet (batch 32)", {}, None),
    "deepmlp": ("DeepMLP", 32, "DeepMLP 48 blocks (batch 32)", {}, None),
    "gpt": ("TinyGPT", 8, "GPT-small (TinyGPT, batch 8)", {}, None),
    # GPT-2 small's shape: 12 layers, d 768, T 512 (vocab 1000): GPU runs; slow on a CPU
    "gpt2s": ("TinyGPT", 8, "GPT-2-small shape (12x768, T 512, batch 8)", _GPT2S, None),
    "gpt2s-bf16": ("TinyGPT", 8, "GPT-2-small shape, bf16 autocast", _GPT2S, "bfloat16"),
}
#: the models run when --models is not given (the gpt2s rows need a GPU to finish in minutes)
DEFAULT_MODELS = {"cpu": ("mlp", "convnet", "deepmlp", "gpt"),
                  "cuda": ("mlp", "convnet", "deepmlp", "gpt", "gpt2s", "gpt2s-bf16")}
TENSOR_MODELS = ("mlp", "convnet")


_SKETCH_TIME = [0.0]  # seconds spent in the host sketches' numpy parts during the current step


def _time_sketches() -> None:
    """Wrap the host sketches' numpy parts with a timer (about 0.2 us per call): every CPU
    sketch goes through sketch.array_sketch (one tensor, now), sketch.fold_into (a larger
    tensor's fold at record time, its product deferred) or host_batch._arena_sketches (the
    products of a batch); array_sketch calls fold_into: the outermost call is timed."""
    from bench.timers import time_calls
    from probe.capture.numbers import host_batch, sketch

    time_calls(sketch, ("array_sketch", "fold_into"), _SKETCH_TIME, time.perf_counter)
    time_calls(host_batch, ("_arena_sketches",), _SKETCH_TIME, time.perf_counter)


class Variant:
    """One way of running a step: baseline, or with a debugger in some configuration."""

    def __init__(self, name, model, optimizer, batch, dump_root, config=None, construct=False,
                 select=True, synchronize=None, autocast=None):
        from examples.models import train_step
        from probe.config import Config
        from probe.debugger.debugger import PrecisionDebugger

        self.name = name
        if autocast is None:
            self._train = lambda: train_step(model, optimizer, *batch)
        else:
            import torch

            device_type, dtype = batch[0].device.type, getattr(torch, autocast)

            def train_under_autocast():
                with torch.autocast(device_type, dtype=dtype):
                    return train_step(model, optimizer, *batch)
            self._train = train_under_autocast
        #: torch.cuda.synchronize on a GPU (a step's time is its kernels' time), else nothing
        self._sync = synchronize or (lambda: None)
        self.model = model
        self.debugger = None
        self.calls = 0
        self.records = None  # records of one captured step (read from its file, untimed)
        self.last_thread = 0.0  # thread CPU seconds of the last step
        self.dump_ratio = None
        self._dump = None
        if construct or config is not None:
            path = os.path.join(dump_root, name.replace(" ", "_"))
            values = dict(config or {}, dump_path=path)
            if not select:
                values["step"] = [10 ** 9]
            self._dump = path
            self.debugger = PrecisionDebugger(Config(**values))
        self._captures = config is not None

    def run(self) -> float:
        """One step; returns seconds. self.last_capture: the same without step()'s file write."""
        debugger = self.debugger
        _SKETCH_TIME[0] = 0.0
        thread_start = time.thread_time()
        start = time.perf_counter()
        if self._captures:
            debugger.start(self.model)
            self._train()
            debugger.stop()
            self._sync()
            self.last_capture = time.perf_counter() - start
            debugger.step()
        else:
            self._train()
        self._sync()
        elapsed = time.perf_counter() - start
        self.last_thread = time.thread_time() - thread_start
        self.last_sketch = _SKETCH_TIME[0]
        if not self._captures:
            self.last_capture = elapsed
        if self._captures and debugger.last_file:
            self.calls = debugger.last_step_calls
            if debugger.config.task == "tensor" and self.dump_ratio is None:
                self.dump_ratio = _dump_ratio(debugger.last_file)
            if self.records is None:
                self.records = _records(debugger.last_file)
            os.remove(debugger.last_file)  # keep the disk small; not timed
            debugger.last_file = None
        return elapsed


def count_dispatches(variant: Variant, device: str) -> tuple[int, int | None]:
    """(torch operators, CUDA kernels) of one step of the variant, counted by torch.profiler
    (untimed; the operators include nested ones, e.g. aten::linear and the aten::addmm it
    calls). Kernels are None off CUDA."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    variant.run()  # warm: lazy tables and caches are not part of a steady step
    with profile(activities=activities) as prof:
        variant.run()
    operators = kernels = 0
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            kernels += 1
        elif event.name.startswith("aten::"):
            operators += 1
    return operators, (kernels if device == "cuda" else None)


def count_launches(variant: Variant) -> int:
    """Kernel-launching aten ops of one step (bench/launch_count.py), after a warm step."""
    from bench import launch_count

    variant.run()
    return launch_count.count(variant.run).total


def sync_error_mode(variant: Variant) -> str:
    """Does one captured CUDA step run with torch.cuda.set_sync_debug_mode("error") between
    start() and stop() (a host synchronisation raises)? "pass", or the first line of the error."""
    import torch

    debugger = variant.debugger
    debugger.start(variant.model)
    torch.cuda.set_sync_debug_mode("error")
    try:
        variant._train()
        result = "pass"
    except RuntimeError as error:
        result = "fails: " + str(error).splitlines()[0][:60]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        debugger.stop()
    debugger.step()
    return result


def _records(path: str) -> int:
    from probe.dump.reader import open_step_file

    with open_step_file(path) as step:
        return len(step.records)


def count_syncs(variant: Variant) -> int:
    """Host synchronisations between start() and stop() of one captured CUDA step: CUDA's
    sync debug mode warns at each one."""
    import warnings

    import torch

    debugger = variant.debugger
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        debugger.start(variant.model)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            variant._train()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            debugger.stop()
    debugger.step()
    return sum(1 for warning in caught if "synchroniz" in str(warning.message).lower())


def _dump_ratio(path: str) -> float:
    from probe.dump.reader import open_step_file

    with open_step_file(path) as step:
        distinct = 0
        for tensor_id in range(step.tensor_count):
            array, _ = step.stored_tensor(tensor_id)
            distinct += array.nbytes
    return os.path.getsize(path) / max(distinct, 1)


def bench_model(key: str, repeats: int, with_tensor: bool, dump_root: str, sketch_only: bool = False,
                device: str = "cpu", count: bool = True, msprobe: bool = False) -> dict:
    import torch

    import examples.models as models

    constructor, batch_size, label, sizes, autocast = MODELS[key]
    torch.manual_seed(0)
    model = getattr(models, constructor)(**sizes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch_kind = "gpt" if constructor == "TinyGPT" else key
    batch = models.make_batch(batch_kind, batch_size, generator=torch.Generator().manual_seed(0),
                              device=device, **sizes)
    sync = torch.cuda.synchronize if device == "cuda" else None
    folder = os.path.join(dump_root, key)  # one dump_path per model and variant: one run each
    make = lambda name, **kw: Variant(name, model, optimizer, batch, folder, synchronize=sync,  # noqa: E731
                                      autocast=autocast, **kw)
    variants = [
        make("baseline"),
        make("stats api", config={"level": "api"}),
        make("no sketch", config={"level": "api", "sketch_size": 0}),
    ]
    if not sketch_only:
        variants[1:1] = [make("not started", construct=True),
                         make("unselected", config={"level": "api"}, select=False)]
        variants += [make("stats module", config={"level": "module"}), make("stats mix", config={"level": "mix"})]
    if with_tensor and not sketch_only:
        variants.append(make("tensor api", config={"level": "api", "task": "tensor"}))
    if msprobe and not sketch_only:
        variants += [msprobe_variants.MsprobeVariant(name, model, optimizer, batch, dump_root, synchronize=sync)
                     for name in msprobe_variants.LEVELS]
    times = {variant.name: [] for variant in variants}
    threads = {variant.name: [] for variant in variants}
    capture_times = {variant.name: [] for variant in variants}
    shares = []
    for _ in range(2):  # warm-up
        for variant in variants:
            variant.run()
    first = variants[0].run()
    # Steps run in blocks of `block` per variant; the first step of a block is not timed:
    # it pays for what the previous variant left behind (cold caches, freed memory), which
    # is noise, not the cost of this variant. Small models need more steps per block.
    block = 4 if first < 0.05 else 2
    # a fresh random order every round (seeded: the same run to run), so no variant always
    # follows the same one
    order = random.Random(0)
    rounds = -(-repeats // (block - 1))
    for _ in range(rounds):
        shuffled = list(variants)
        order.shuffle(shuffled)
        for variant in shuffled:
            gc.collect()  # untimed: no variant inherits another one's garbage
            variant.run()
            for _ in range(block - 1):
                times[variant.name].append(variant.run())
                threads[variant.name].append(variant.last_thread)
                capture_times[variant.name].append(variant.last_capture)
                if variant.name == "stats api":
                    shares.append(variant.last_sketch / (times[variant.name][-1] - variant.last_sketch))
    base = statistics.median(times["baseline"])
    by_name = {variant.name: variant for variant in variants}
    result = {"model": key, "label": label, "baseline_ms": base * 1e3, "repeats": repeats,
              "device": device}
    if count:
        plain_ops, plain_kernels = count_dispatches(by_name["baseline"], device)
        ops, kernels = count_dispatches(by_name["stats api"], device)
        result.update(ops_plain=plain_ops, ops_captured=ops, ops_ratio=ops / max(plain_ops, 1),
                      kernels_plain=plain_kernels, kernels_captured=kernels,
                      kernels_ratio=None if kernels is None else kernels / max(plain_kernels, 1))
        plain_launches = count_launches(by_name["baseline"])
        launches = count_launches(by_name["stats api"])
        result.update(launches_plain=plain_launches, launches_api=launches,
                      launches_allowed=1.25 * plain_launches + 30)
        if device == "cuda":
            result["syncs_api"] = count_syncs(by_name["stats api"])
            result["sync_error_mode"] = sync_error_mode(by_name["stats api"])
        if "msprobe L1" in by_name:
            result["ops_msprobe_L1"], result["kernels_msprobe_L1"] = count_dispatches(by_name["msprobe L1"], device)
    for variant in variants[1:]:
        result[variant.name] = statistics.median(times[variant.name]) / base
    result["sketch cost"] = statistics.median(times["stats api"]) / statistics.median(times["no sketch"])
    result["sketch share"] = statistics.median(shares)
    capture_only = statistics.median(capture_times["stats api"])
    result["stats api capture"] = capture_only / base
    calls = by_name["stats api"].calls
    result["calls_per_step"] = calls
    extra = (statistics.median(times["stats api"]) - base) * 1e6
    result["us_per_call"] = extra / calls if calls else float("nan")
    result["us_per_call_capture"] = (capture_only - base) * 1e6 / calls if calls else float("nan")
    records = by_name["stats api"].records
    result["records_per_step"] = records
    if records:
        host = statistics.median(threads["stats api"]) - statistics.median(threads["baseline"])
        result["host_us_per_record"] = host * 1e6 / records
    result["dump_over_distinct"] = by_name["tensor api"].dump_ratio if "tensor api" in by_name else None
    for name in msprobe_variants.LEVELS:
        if name in by_name:  # records in one step's dump.json
            result[f"{name.replace(' ', '_')}_records"] = by_name[name].calls
    for variant in variants:
        if isinstance(variant, Variant) and variant.debugger is not None:
            # the writer's last step file lands before main() removes the dump folder
            variant.debugger.close()
    return result


COLUMNS = [
    ("model", "{}", "label"),
    ("baseline ms", "{:.2f}", "baseline_ms"),
    ("not started", "{:.3f}x", "not started"),
    ("unselected", "{:.3f}x", "unselected"),
    ("stats api", "{:.2f}x", "stats api"),
    ("no sketch", "{:.2f}x", "no sketch"),
    ("sketch cost", "{:.3f}x", "sketch cost"),
    ("sketch share", "{:.1%}", "sketch share"),
    ("(no write)", "{:.2f}x", "stats api capture"),
    ("stats module", "{:.2f}x", "stats module"),
    ("stats mix", "{:.2f}x", "stats mix"),
    ("msprobe L1", "{:.2f}x", "msprobe L1"),
    ("msprobe L0", "{:.2f}x", "msprobe L0"),
    ("tensor api", "{:.2f}x", "tensor api"),
    ("calls/step", "{}", "calls_per_step"),
    ("ops plain", "{}", "ops_plain"),
    ("ops api", "{}", "ops_captured"),
    ("ops ratio", "{:.1f}x", "ops_ratio"),
    ("kernels plain", "{}", "kernels_plain"),
    ("kernels api", "{}", "kernels_captured"),
    ("kernels ratio", "{:.1f}x", "kernels_ratio"),
    ("ops msprobe L1", "{}", "ops_msprobe_L1"),
    ("kernels msprobe L1", "{}", "kernels_msprobe_L1"),
    ("syncs api", "{}", "syncs_api"),
    ("sync error mode", "{}", "sync_error_mode"),
    ("launches plain", "{}", "launches_plain"),
    ("launches api", "{}", "launches_api"),
    ("allowed", "{:.0f}", "launches_allowed"),
    ("records", "{}", "records_per_step"),
    ("host us/record", "{:.1f}", "host_us_per_record"),
    ("us/call", "{:.1f}", "us_per_call"),
    ("(no write)", "{:.1f}", "us_per_call_capture"),
    ("dump/distinct", "{:.3f}x", "dump_over_distinct"),
]


def format_table(results: list[dict]) -> str:
    header = [name for name, _, _ in COLUMNS]
    lines = []
    for result in results:
        cells = []
        for _, fmt, key in COLUMNS:
            value = result.get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append(cells)
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in lines]
    return "\n".join(out)


def msprobe_footer(with_msprobe: bool, args) -> str:
    if with_msprobe:
        return (f"msprobe: mindstudio-probe {msprobe_variants.version()}, task statistics, every step, "
                "extra_info off, L0 on its own copy of the model (bench/msprobe_variants.py)")
    if args.sketch_only:
        return "msprobe columns: left out with --sketch-only"
    if args.no_msprobe:
        return "msprobe columns: left out (--no-msprobe)"
    return f"msprobe columns: mindstudio-probe is not installed here; {msprobe_variants.INSTALL_HINT}"


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str], int]:
    """(the arguments, the models to run, timed steps per variant); exits on a bad argument."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--models", default=None,
                        help=f"comma-separated subset of {', '.join(MODELS)} (default: "
                             f"{', '.join(DEFAULT_MODELS['cpu'])}; on cuda also gpt2s, gpt2s-bf16)")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per variant (>= 10)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: mlp and convnet, 5 repeats (numbers are rough)")
    parser.add_argument("--tensor-models", default=",".join(TENSOR_MODELS),
                        help="models that also run the tensor-mode variant")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the models train (cuda: timings synchronise every step, and "
                             "kernels per step are counted)")
    parser.add_argument("--no-count", action="store_true",
                        help="skip the torch.profiler count of operators (and kernels) per step")
    parser.add_argument("--sketch-only", action="store_true",
                        help="only baseline, stats api and stats api without sketch (the sketch's cost)")
    parser.add_argument("--no-msprobe", action="store_true",
                        help="leave out the msprobe columns even where mindstudio-probe is installed")
    args = parser.parse_args(argv)
    models = [m for m in (args.models or ",".join(DEFAULT_MODELS[args.device])).split(",") if m]
    repeats = args.repeats
    if args.quick:
        models = [m for m in models if m in ("mlp", "convnet")] or ["mlp"]
        repeats = 5
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    return args, models, repeats


def main(argv=None) -> int:
    args, models, repeats = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("dump_overhead.py: error: --device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    _time_sketches()
    tensor_models = set(args.tensor_models.split(","))
    with_msprobe = msprobe_variants.available() and not args.no_msprobe and not args.sketch_only
    dump_root = tempfile.mkdtemp(prefix="probe-bench-")
    results = []
    try:
        for key in models:
            print(f"benchmarking {key} ...", file=sys.stderr, flush=True)
            results.append(bench_model(key, repeats, key in tensor_models, dump_root, args.sketch_only,
                                       args.device, not args.no_count, with_msprobe))
    finally:
        shutil.rmtree(dump_root, ignore_errors=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if args.json:
        print(json.dumps({"torch": torch.__version__, "threads": 1, "load_average": load,
                          "device": args.device, "msprobe": msprobe_variants.version() if with_msprobe else None,
                          "optimizer": "SGD(lr=0.01)", "results": results}, indent=2))
    else:
        print(format_table(results))
        print(f"\ntorch {torch.__version__}, 1 thread, SGD(lr=0.01), median of at least "
              f"{repeats} interleaved steps per variant, 1-minute load average at the end "
              f"{load:.2f}, device {args.device}")
        print(msprobe_footer(with_msprobe, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
