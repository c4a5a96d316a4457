"""Host time per captured record: what capture costs the training thread, per record.

    python bench/record_cost.py                          # gpt and gpt2s-t16, levels mix, api, module
    python bench/record_cost.py --models gpt --repeats 9
    python bench/record_cost.py --levels api --paths host
    python bench/record_cost.py --json
    python bench/record_cost.py --models gpt --levels api --paths records --floor   # beside the floor
    python bench/record_cost.py --device cuda --paths device,records   # on a GPU
    python bench/record_cost.py --models llama,litgpt --paths records --floor   # real libraries
    python bench/record_cost.py --paths records --gc-threshold 700   # Python's default threshold

One training step = forward + cross-entropy + backward + SGD step (examples.models.train_step),
one torch thread. A captured step is start(model), the step, stop(), step(): the records, their
numbers and the hand-over of the step file (the writer process writes it off this thread when
the machine has a second CPU). Every number is CPU time of the training thread
(``time.thread_time``), the median of --repeats timed steps, every variant in this one process,
interleaved in blocks in a new random order every round (the first step of a block untimed,
``gc.collect()`` before it).

Models: ``gpt`` is the project's GPT (examples.models.TinyGPT: 4 layers, d 256, T 128, batch 1);
``gpt2s`` has GPT-2 small's shape (12 layers, d 768, 12 heads, T 128, batch 2; vocabulary 1000);
``gpt2s-t16`` the same layers at T 16, batch 1: the same calls and records, in a step short
enough on a CPU (about 0.3 s against 1.2) for the capture's time to stand out of the step's
spread (the default on a CPU; gpt2s on a GPU). Real libraries, as a new user trains them (random
init from a config, nothing downloaded; each skipped with what to install where it is missing):
``llama`` a transformers LlamaForCausalLM (4 layers, hidden 64, 4 heads, 2 key-value heads,
vocabulary 128, T 32, batch 2; its own loss from ``labels``); ``litgpt`` a litgpt GPT of the same
size, cross-entropy on its logits.

Paths:
  host     CPU tensors' numbers computed on the CPU as they are recorded (the default on a CPU)
  device   the accelerator's path on CPU tensors (PROBE_DEVICE_PATH=1): tensors are held in
           buckets and their numbers computed in a fixed number of torch calls per bucket
           (on a CPU the held tensors also keep the allocator from reusing their memory: a
           cost a GPU's caching allocator does not have)
  records  the records alone: every tensor's numbers are taken as known (numbers_of
           answers at once, computing nothing): the per-record work of the capture itself,
           which is what a GPU's host pays per record besides the bucket's launches
  floor    (--floor; a row per level) not probe: bench/capture_floor.py, the least a capture
           in Python pays per record at that level (calls named, tensors' layouts kept,
           hooks for the gradients, nothing else). Compare its us/record with the "records"
           path's

Columns:
  records      records of one captured step
  plain ms     the step without probe
  captured ms  the captured step
  us/record    (captured - plain) / records
  numbers ms   time inside the device bucket's flushes and its copy to the host (device path):
               the work a GPU does (its launches stay on the host: ``launches`` below)
  host us/record   (captured - plain - numbers) / records: what the host pays per record when
               the device computes the numbers (the host path's own arithmetic is in us/record)
  fixed ms     of captured ms, the time in start(), stop() and step(): hooks installed and
               removed, the rows built, the step file handed over (paid once a step)
  gc ms        of captured ms, the time in Python's garbage collections (gc.callbacks): what the
               objects the capture keeps during the step set off (probe/capture/collector.py)
  in-step us/record   (captured - fixed - plain) / records: what the records cost while the
               step runs (their share of the numbers too, on the device path)
  launches     device path: torch ops of the captured step that launch a kernel on a GPU,
               against the plain step's (bench/launch_count.py counts them)

On a GPU (--device cuda) the model and batch live there and the device path is the one a
GPU takes (--paths device,records; host reads every record's numbers with a host sync). The
clock stops while torch.cuda.synchronize() waits for the device before stop() and after each
step, so every number stays the host's own time; the one copy to the host at step() still
waits for the bucket's last kernels, a wait the capture adds.

Target: host us/record <= 10 at every level on both models (docs/performance.md), on the
"records" path here, on the device path on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
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

MODELS = {
    # name: (label, TinyGPT sizes, batch)
    "gpt": ("GPT (4 x 256, T 128, batch 1)", {}, 1),
    "gpt2s": ("GPT-2-small shape (12 x 768, T 128, batch 2)",
              {"d_model": 768, "n_heads": 12, "n_layers": 12, "max_len": 128}, 2),
    # GPT-2 small's layers at a length of 16: the same calls and records a step as gpt2s, in a
    # step short enough that the capture's time stands out of the step's spread
    "gpt2s-t16": ("GPT-2-small shape at T 16 (12 x 768, T 16, batch 1)",
                  {"d_model": 768, "n_heads": 12, "n_layers": 12, "max_len": 16}, 1),
    # a smoke test's model (the suite runs it): rough numbers
    "tiny": ("GPT (2 x 64, T 32, batch 1)", {"d_model": 64, "n_layers": 2, "max_len": 32}, 1),
    # real libraries' models (_library_workload): sizes here are theirs, not TinyGPT's
    "llama": ("transformers Llama (4 x 64, T 32, batch 2)", {"layers": 4, "width": 64, "length": 32}, 2),
    "litgpt": ("litgpt GPT (4 x 64, T 32, batch 2)", {"layers": 4, "width": 64, "length": 32}, 2),
}
#: the real-library models: what each needs installed
LIBRARIES = {"llama": "transformers", "litgpt": "litgpt"}
VOCAB = 128
LEVELS = ("mix", "api", "module")
PATHS = ("host", "device", "records")
#: --models and --paths when not given, per --device (on a GPU the host path would read every
#: record's numbers back with a sync: not what is measured there)
DEFAULTS = {"cpu": {"models": "gpt,gpt2s-t16", "paths": ",".join(PATHS)},
            "cuda": {"models": "gpt,gpt2s", "paths": "device,records"}}

_NUMBERS = [0.0]  # thread CPU seconds inside the device bucket's flushes during this step
_COLLECTING = [0.0, 0.0]  # thread CPU seconds in garbage collections during this step; the last start


def _time_collection(phase: str, info: dict) -> None:
    """A gc.callbacks entry: adds each garbage collection's time to _COLLECTING[0]."""
    if phase == "start":
        _COLLECTING[1] = time.thread_time()
    else:
        _COLLECTING[0] += time.thread_time() - _COLLECTING[1]


def _time_bucket() -> None:
    """Time DeviceBucket.flush and DeviceBucket.resolve (a few calls a step)."""
    from bench.timers import time_calls
    from probe.capture import DeviceBucket

    time_calls(DeviceBucket, ("flush", "resolve"), _NUMBERS, time.thread_time)


_ROUTE: list = []


@contextlib.contextmanager
def device_path(on: bool):
    """PROBE_DEVICE_PATH set to 1 (CPU tensors take the accelerator's capture path) or 0 while
    the block runs, as it was after."""
    saved = os.environ.get("PROBE_DEVICE_PATH")
    os.environ["PROBE_DEVICE_PATH"] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PROBE_DEVICE_PATH"]
        else:
            os.environ["PROBE_DEVICE_PATH"] = saved


def _numbers_known(on: bool) -> None:
    """The "records" path: the recorder's numbers_of answers at once with fixed numbers."""
    from probe.capture import recorder

    if not _ROUTE:
        _ROUTE.append(recorder.numbers_of)
    known = ((0.0, 0.0, 0.0, 0.0, 0, 0), None, None)
    recorder.numbers_of = (lambda *args, **kwargs: known) if on else _ROUTE[0]


class FloorVariant:
    """The step under bench/capture_floor.py's floor capture at a level: the least a capture
    in Python pays per record (a row of path "floor")."""

    path, debugger = "floor", None

    def __init__(self, train, model, level: str, sync=None) -> None:
        self.name = f"{level} floor"
        self.level = level
        self._train = train
        self._model = model
        self._sync = sync or (lambda: None)
        self.records = 0

    def run(self) -> tuple[float, float, float]:
        """One step: (thread CPU seconds, 0, of which installing and removing the hooks)."""
        from bench.capture_floor import floor_capture

        self._sync()
        _COLLECTING[0] = 0.0
        clock = time.thread_time
        began = clock()
        with floor_capture(self._model, self.level) as records:
            started = clock()
            self._train()
            trained = clock()
        ended = clock()
        self._sync()
        self.records = len(records)
        return ended - began, 0.0, (started - began) + (ended - trained)

    def count_records(self) -> None:
        pass

    def tidy(self) -> None:
        pass


class Variant:
    """The plain step, or a captured one at a level on a path."""

    def __init__(self, name, train, model, dump_root, level=None, path="host", writer="auto",
                 sync=None):
        self.name = name
        self._train = train
        #: waits for the device (torch.cuda.synchronize), with the clock stopped; None on a CPU
        self._sync = sync or (lambda: None)
        self._model = model
        self.level = level
        self.path = path
        self.debugger = None
        self.records = 0
        if level is not None:
            from probe.config import Config
            from probe.debugger.debugger import PrecisionDebugger

            self._folder = os.path.join(dump_root, name.replace(" ", "_"))
            self.debugger = PrecisionDebugger(Config(dump_path=self._folder, level=level, writer=writer))

    def run(self) -> tuple[float, float, float]:
        """One step: (thread CPU seconds, of which inside the device bucket, of which in
        start(), stop() and step())."""
        _NUMBERS[0] = _COLLECTING[0] = 0.0
        clock = time.thread_time
        sync = self._sync
        sync()
        if self.debugger is None:
            began = clock()
            self._train()
            spent = clock() - began
            sync()
            return spent, 0.0, 0.0
        with device_path(self.path == "device"):
            if self.path == "records":
                _numbers_known(True)
            try:
                began = clock()
                self.debugger.start(self._model)
                started = clock()
                self._train()
                trained = clock()
                sync()
                resumed = clock()
                self.debugger.stop()
                self.debugger.step()
                ended = clock()
                sync()
            finally:
                _numbers_known(False)
        return (trained - began) + (ended - resumed), _NUMBERS[0], (started - began) + (ended - resumed)

    def count_records(self) -> None:
        """Records of the last captured step, read from its file (untimed)."""
        from probe.dump.reader import load

        self.debugger.wait()
        step = self.debugger.current_step - 1
        self.records = sum(1 for _ in load(self._folder).records(step=step))

    def tidy(self) -> None:
        """Delete the step files written so far (untimed): keeps the disk small."""
        if self.debugger is not None:
            self.debugger.wait()
            for name in os.listdir(self._folder):
                if name.endswith(".h5"):
                    os.remove(os.path.join(self._folder, name))


def bench_model(key: str, levels, paths, repeats: int, dump_root: str, writer: str = "auto",
                device: str = "cpu", floor: bool = False) -> list[dict]:
    import torch

    import examples.models as models

    label, sizes, batch_size = MODELS[key]
    torch.manual_seed(0)
    if key in LIBRARIES:
        model, train = _library_workload(key, sizes, batch_size, device)
    else:
        model = models.TinyGPT(**sizes).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batch = models.make_batch("gpt", batch_size, generator=torch.Generator().manual_seed(0), device=device,
                                  **sizes)

        def train():
            models.train_step(model, optimizer, *batch)
    sync = torch.cuda.synchronize if device == "cuda" else None

    folder = os.path.join(dump_root, key)
    variants = [Variant("plain", train, model, folder, sync=sync)]
    variants += [Variant(f"{level} {path}", train, model, folder, level, path, writer, sync)
                 for level in levels for path in paths]
    if floor:
        variants += [FloorVariant(train, model, level, sync) for level in levels]
    for variant in variants:  # warm-up: lazy tables, layouts, the writer process
        for _ in range(2):
            variant.run()
        if variant.level is not None:
            variant.count_records()
            variant.tidy()
    times = {variant.name: [] for variant in variants}
    numbers = {variant.name: [] for variant in variants}
    fixed = {variant.name: [] for variant in variants}
    collecting = {variant.name: [] for variant in variants}
    order = random.Random(0)
    block = 3
    for _ in range(-(-repeats // (block - 1))):
        shuffled = list(variants)
        order.shuffle(shuffled)
        for variant in shuffled:
            gc.collect()
            variant.run()  # untimed: pays for what the previous variant left behind
            for _ in range(block - 1):
                spent, inside, once = variant.run()
                times[variant.name].append(spent)
                numbers[variant.name].append(inside)
                fixed[variant.name].append(once)
                collecting[variant.name].append(_COLLECTING[0])
            variant.tidy()
    plain = statistics.median(times["plain"])
    rows = []
    for variant in variants[1:]:
        captured = statistics.median(times[variant.name])
        inside = statistics.median(numbers[variant.name])
        once = statistics.median(fixed[variant.name])
        records = max(variant.records, 1)
        rows.append({"model": key, "label": label, "device": device, "level": variant.level, "path": variant.path,
                     "records": variant.records, "plain_ms": plain * 1e3,
                     "captured_ms": captured * 1e3, "numbers_ms": inside * 1e3,
                     "us_per_record": (captured - plain) * 1e6 / records,
                     "host_us_per_record": (captured - plain - inside) * 1e6 / records,
                     "fixed_ms": once * 1e3,
                     "gc_ms": statistics.median(collecting[variant.name]) * 1e3,
                     "in_step_us_per_record": (captured - once - plain) * 1e6 / records,
                     "repeats": len(times[variant.name])})
    for variant in variants:
        if variant.debugger is not None:
            variant.debugger.close()
    return rows


def _library_workload(key: str, sizes: dict, batch_size: int, device: str):
    """(model, one training step) of a real library's model: a forward, its loss, backward and
    SGD(lr=0.01) with zero_grad, as a user's loop does it."""
    import torch

    tokens = torch.randint(0, VOCAB, (batch_size, sizes["length"]), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    if key == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=sizes["width"], intermediate_size=2 * sizes["width"],
                             num_hidden_layers=sizes["layers"], num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=2 * sizes["length"])
        model = LlamaForCausalLM(config).to(device)

        def loss():
            return model(input_ids=tokens, labels=tokens).loss
    else:
        from litgpt import GPT, Config

        model = GPT(Config(block_size=2 * sizes["length"], vocab_size=VOCAB, padded_vocab_size=VOCAB,
                           n_layer=sizes["layers"], n_head=4, n_embd=sizes["width"])).to(device)

        def loss():
            return torch.nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train():
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    return model, train


COLUMNS = [("model", "{}", "model"), ("level", "{}", "level"), ("path", "{}", "path"),
           ("records", "{}", "records"), ("plain ms", "{:.1f}", "plain_ms"),
           ("captured ms", "{:.1f}", "captured_ms"), ("us/record", "{:.1f}", "us_per_record"),
           ("numbers ms", "{:.1f}", "numbers_ms"), ("host us/record", "{:.1f}", "host_us_per_record"),
           ("fixed ms", "{:.1f}", "fixed_ms"), ("gc ms", "{:.2f}", "gc_ms"),
           ("in-step us/record", "{:.1f}", "in_step_us_per_record")]


def format_table(rows: list[dict]) -> str:
    header = [name for name, _, _ in COLUMNS]
    cells = [[fmt.format(row[key]) for _, fmt, key in COLUMNS] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str], list[str], list[str]]:
    """(the arguments, models, levels, paths); exits on a bad argument."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    def by_device(key: str) -> str:
        return ", ".join(f"{chosen[key]} on {device}" for device, chosen in DEFAULTS.items())

    parser.add_argument("--models", default=None,
                        help=f"comma-separated subset of {', '.join(MODELS)} (default: {by_device('models')})")
    parser.add_argument("--levels", default=",".join(LEVELS), help="comma-separated capture levels")
    parser.add_argument("--paths", default=None,
                        help=f"comma-separated subset of {', '.join(PATHS)} (default: {by_device('paths')})")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the models train")
    parser.add_argument("--repeats", type=int, default=6, help="timed steps per variant")
    parser.add_argument("--writer", default="auto", choices=("auto", "process", "inline"),
                        help="the config's writer (auto: a writer process where a second CPU is free)")
    parser.add_argument("--floor", action="store_true",
                        help="add a row per model and level for bench/capture_floor.py: the least a "
                             "capture in Python pays per record")
    parser.add_argument("--gc-threshold", type=int, default=None,
                        help="the garbage collector's first threshold while a step is captured, "
                             "at every step (default: probe's, which grows with the previous "
                             "step's calls: probe/capture/collector.py; 700 is Python's own: what "
                             "the collector costs without probe's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    chosen = DEFAULTS[args.device]
    models = [m for m in (args.models or chosen["models"]).split(",") if m]
    levels = [m for m in args.levels.split(",") if m]
    paths = [m for m in (args.paths or chosen["paths"]).split(",") if m]
    for given, allowed, what in ((models, MODELS, "model"), (levels, LEVELS, "level"), (paths, PATHS, "path")):
        unknown = [m for m in given if m not in allowed]
        if unknown:
            parser.error(f"unknown {what}(s) {', '.join(unknown)}; choose from {', '.join(allowed)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.gc_threshold is not None and args.gc_threshold < 1:
        parser.error("--gc-threshold must be at least 1")
    import importlib.util

    missing = [f"{m} needs {LIBRARIES[m]} (pip install {LIBRARIES[m]})" for m in models
               if m in LIBRARIES and importlib.util.find_spec(LIBRARIES[m]) is None]
    if missing:
        parser.error("; ".join(missing))
    return args, models, levels, paths


def main(argv=None) -> int:
    args, models, levels, paths = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("record_cost.py: error: --device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    _time_bucket()
    from probe.capture import collector

    chosen_threshold, per_call = collector.CAPTURE_THRESHOLD, collector.PER_CALL
    if args.gc_threshold is not None:  # this threshold at every step, however many calls
        collector.CAPTURE_THRESHOLD, collector.PER_CALL = args.gc_threshold, 0
    gc.callbacks.append(_time_collection)
    dump_root = tempfile.mkdtemp(prefix="probe-record-cost-")
    rows = []
    try:
        for key in models:
            print(f"benchmarking {key} ...", file=sys.stderr, flush=True)
            rows += bench_model(key, levels, paths, args.repeats, dump_root, args.writer, args.device,
                                args.floor)
    finally:
        gc.callbacks.remove(_time_collection)
        collector.CAPTURE_THRESHOLD, collector.PER_CALL = chosen_threshold, per_call
        shutil.rmtree(dump_root, ignore_errors=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    threshold = args.gc_threshold or "probe's (it grows with the previous step's calls)"
    if args.json:
        print(json.dumps({"torch": torch.__version__, "threads": 1, "load_average": load,
                          "device": args.device, "gc_threshold": args.gc_threshold,
                          "rows": rows}, indent=2))
    else:
        print(format_table(rows))
        print(f"\ntorch {torch.__version__}, 1 thread, SGD(lr=0.01), thread CPU time, median of "
              f"{args.repeats}+ interleaved steps per variant, 1-minute load average at the end {load:.2f}, "
              f"device {args.device}, garbage collector's first threshold while captured "
              f"{threshold}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
