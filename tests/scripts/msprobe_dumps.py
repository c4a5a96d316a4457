"""Train one of the project's models a few steps under msprobe's or probe's debugger, one dump.

    python tests/scripts/msprobe_dumps.py --tool msprobe --model mlp --variant clean OUT
    python tests/scripts/msprobe_dumps.py --tool probe --model mlp --level mix OUT

--tool msprobe needs mindstudio-probe 26.2.0 in the interpreter that runs this (it patches
torch for the rest of its process, so run it on its own); --tool probe needs probe. Both runs
of one model, variant and seed compute the same numbers, so their dumps are of the same run.

Variants (B's side of a verdict case):
  clean       the model as it is
  extra_call  one more F.linear call before each forward, outside every module: msprobe's
              counters of every later linear shift by one
  bf16        one linear layer computes in bfloat16 (its inputs and weights cast, the output
              cast back to float32): introduced at that layer's linear
  scaled      one weight scaled by 1 + 1e-3 before training: introduced where it is read
  inplace     the MLP's ReLU made in place
  nonfinite   three more calls before each forward, outside every module: one makes -inf, one
              NaN, one a float64 tensor (msprobe writes bare -Infinity and NaN tokens, and no
              Mean or Norm for float64)

--ranks 2 runs two processes under torch.distributed (gloo), each training its own copy on
its own batch: msprobe writes rank0/ and rank1/, probe rank0.h5 and rank1.h5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
from models import MLP, DeepMLP, SmallConvNet, TinyGPT, make_batch, train_step  # noqa: E402

#: tiny sizes of the project's models (tests stay fast, fixtures small)
SIZES = {
    "mlp": dict(in_features=8, out_features=3),
    "deepmlp": dict(in_features=8, out_features=3),
    "gpt": dict(vocab=32, max_len=6),
    "convnet": {},
}
#: the layer a variant changes, per model
LAYER = {"mlp": "fc2", "deepmlp": "blocks.1.fc", "gpt": "blocks.0.mlp.0", "convnet": "fc1"}
WEIGHT = {"mlp": "fc1", "deepmlp": "blocks.1.fc", "gpt": "blocks.0.attn.qkv", "convnet": "conv2"}
LEVELS_PROBE = {"mix": "mix", "L0": "module", "L1": "api"}


def build(name: str, variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP(8, 16, 3)
        if variant == "inplace":
            model.act = torch.nn.ReLU(inplace=True)
    elif name == "deepmlp":
        model = DeepMLP(8, 16, 3, 3)
    elif name == "gpt":
        model = TinyGPT(vocab=32, d_model=16, n_heads=2, n_layers=2, max_len=6)
    else:
        model = SmallConvNet()
    if variant == "bf16":
        layer = model.get_submodule(LAYER[name])
        layer.forward = lambda x, layer=layer: F.linear(
            x.to(torch.bfloat16), layer.weight.to(torch.bfloat16), layer.bias.to(torch.bfloat16)).float()
    if variant == "scaled":
        with torch.no_grad():
            model.get_submodule(WEIGHT[name]).weight.mul_(1 + 1e-3)
    if variant == "extra_call":
        model.register_forward_pre_hook(_extra_call)
    if variant == "nonfinite":
        model.register_forward_pre_hook(_nonfinite_calls)
    return model


def _extra_call(module, args) -> None:
    F.linear(torch.ones(1, 2), torch.ones(3, 2))


def _nonfinite_calls(module, args) -> None:
    torch.log(torch.tensor([1.0, 0.0]))
    torch.div(torch.tensor([0.0, 1.0]), 0.0)
    torch.mul(torch.ones(3, dtype=torch.float64), 2.0)


def debugger(tool: str, task: str, level: str, out: str, only=(), data_mode=("all",), summary="statistics"):
    if tool == "probe":
        from probe.config import from_dict
        from probe.debugger.debugger import PrecisionDebugger

        return PrecisionDebugger(from_dict({"task": task, "level": LEVELS_PROBE[level], "dump_path": out,
                                            "writer": "inline"}))
    from msprobe.pytorch import PrecisionDebugger

    config = {"task": task, "dump_path": out, "rank": [], "step": [], "level": level,
              task: {"scope": [], "list": list(only), "data_mode": list(data_mode)}}
    if task == "statistics":
        config[task]["summary_mode"] = summary
    handle, path = tempfile.mkstemp(suffix=".json")
    with os.fdopen(handle, "w") as file:
        json.dump(config, file)
    return PrecisionDebugger(config_path=path)


def train(args, rank: int = 0) -> None:
    model = build(args.model, args.variant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1 + rank)
    batch = 2 if args.model == "convnet" else 4
    dump = debugger(args.tool, args.task, args.level, args.out, args.list, args.data_mode, args.summary_mode)
    for _ in range(args.steps):
        x, y = make_batch(args.model, batch, generator, **SIZES[args.model])
        dump.start(model)
        train_step(model, optimizer, x, y)
        dump.stop()
        dump.step()


def _rank_main(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.ranks))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=args.ranks)
    try:
        train(args, rank)
    finally:
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--tool", choices=("msprobe", "probe"), default="msprobe")
    parser.add_argument("--model", choices=tuple(SIZES), default="mlp")
    parser.add_argument("--variant", choices=("clean", "extra_call", "bf16", "scaled", "inplace", "nonfinite"),
                        default="clean")
    parser.add_argument("--task", choices=("statistics", "tensor"), default="statistics")
    parser.add_argument("--level", choices=tuple(LEVELS_PROBE), default="mix")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--list", nargs="*", default=[], help="msprobe only: dump the calls whose names hold one")
    parser.add_argument("--data-mode", nargs="*", default=["all"], help="msprobe only: all, forward, backward, ...")
    parser.add_argument("--summary-mode", default="statistics", help="msprobe only: statistics, md5 or xor")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.ranks > 1:
        import socket

        with socket.socket() as probe_port:
            probe_port.bind(("127.0.0.1", 0))
            port = probe_port.getsockname()[1]
        torch.multiprocessing.spawn(_rank_main, args=(args, port), nprocs=args.ranks)
    else:
        train(args)


if __name__ == "__main__":
    main()
