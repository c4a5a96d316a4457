"""Tiny sharded training runs for the sharded-capture tests: FSDP2, DDP, tensor parallel.

Run under ``python -m torch.distributed.run --standalone --nproc_per_node 2`` with
``OUT_DIR SCENARIO...``: each scenario trains a fresh copy of the same model (same initial
weights on every rank) for STEPS steps, and writes ``OUT_DIR/<scenario>.rank<R>.json``
(the losses, as float.hex), ``<scenario>.rank<R>.warnings.json`` (probe's warnings) and, when it captures, a dump under ``OUT_DIR/<scenario>``.
A scenario name is ``<stack>-<capture>[-<variant>...]``:

    stack    fsdp (fully_shard on each Linear and on the root), ddp, tp (ColwiseParallel on
             the first Linear, RowwiseParallel on the second), one (no parallelism),
             coll (no training: a Linear's output all-reduced with dist.all_reduce, then tanh),
             bwcoll (a Linear whose output's gradient a tensor hook all-reduces in backward)
    capture  none, or <level>.<task> (mix.statistics, api.tensor, ...)
    variant  keep (reshard_after_forward False), root (fsdp: fully_shard on the root only), block (fsdp:
             on the first Linear and the root: the second Linear's parameters are in the
             root's group, as the Linears of a block wrapped whole are in the block's), bf16 (MixedPrecisionPolicy param_dtype
             bfloat16), tanh1 (rank 1 alone uses the tanh GELU), scale1 (rank 1's shard of
             the first Linear's weight times 1.001), fault1 (coll: rank 1's all-reduce
             result times 1.001, as a faulty collective would give it), replica1 (rank 1's
             copy of the second Linear's replicated bias times 1.001), data (per-rank batches for tp/one:
             the batch of rank 0; default for ddp and fsdp: each rank its own), xgrad (the
             batch requires grad), adamwbn (a BatchNorm after the second Linear, whose
             bias gradient is rounding noise, and AdamW, which turns that noise into
             lr-sized updates), llama (the model is a tiny random-init transformers Llama, 2
             steps on token batches; tp: q/k/v/gate/up ColwiseParallel, o/down RowwiseParallel;
             fsdp: fully_shard on each decoder layer and on the root)

Run with plain ``python`` (no torchrun), the scenarios of stack ``one`` train on one device:
``python tests/scripts/sharded_train.py OUT one-mix.statistics-llama``.

An ``example-<script>[-<option>...]`` scenario runs examples/distributed/train_<script>.py
for one step, dumped under OUT_DIR/<scenario>, with --<option> (bugR: --bug-rank R).

The rank process ends with os._exit(0) once its output is flushed (see test_distributed.py).
"""

import json
import os
import sys
import warnings

import torch
import torch.nn as nn

STEPS = 3
IN, HIDDEN, OUT = 8, 16, 4


def build(approximate="none", norm=False):
    """norm: a BatchNorm after the second Linear, whose bias then has a gradient that is zero
    but for rounding noise (the batch mean it shifts is taken out again)."""
    torch.manual_seed(0)
    layers = [nn.Linear(IN, HIDDEN), nn.GELU(approximate=approximate), nn.Linear(HIDDEN, OUT)]
    if norm:
        layers.append(nn.BatchNorm1d(OUT))
    return nn.Sequential(*layers)


def fully_shard_api():
    """(fully_shard, MixedPrecisionPolicy): public from torch 2.6, _composable before."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def batches(seed):
    data = torch.Generator().manual_seed(seed)
    return [torch.randn(4, IN, generator=data) for _ in range(STEPS)]


#: the tiny Llama: 2 decoder layers of width 32, 4 heads sharing 2 key/value heads
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
LLAMA_STEPS, LLAMA_SEQUENCE = 2, 8


def build_llama():
    """The same random-init transformers Llama on every rank and device (nothing downloaded);
    eager attention, whose reshapes to (batch, sequence, -1, head_dim) leave a tensor-parallel
    rank its own heads."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def llama_batches(seed):
    data = torch.Generator().manual_seed(seed)
    return [torch.randint(0, LLAMA["vocab_size"], (2, LLAMA_SEQUENCE), generator=data)
            for _ in range(LLAMA_STEPS)]


def llama_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def square_loss(model, x):
    return model(x).square().mean()


def train(model, xs, debugger=None, adamw=False, loss_of=square_loss):
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if adamw
                 else torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for x in xs:
        if debugger is not None:
            debugger.start(model)
        optimizer.zero_grad()
        loss = loss_of(model, x)
        loss.backward()
        optimizer.step()
        if debugger is not None:
            debugger.stop()
            debugger.step()
        losses.append(float(loss.detach()).hex())
    if debugger is not None:
        debugger.close()
    return losses


def debugger_for(capture, dump_path):
    if capture == "none":
        return None
    import probe

    level, task = capture.split(".")
    return probe.PrecisionDebugger(probe.Config(
        dump_path=dump_path, level=level, task=task, step=[], rank=[]))


def parallel_llama(stack, variants, rank):
    """The tiny Llama as each stack shards it, as torchtitan's parallelize does; scale1
    (tp): rank 1's shard of the first layer's query weight times 1.001."""
    model = build_llama()
    if stack == "fsdp":
        fully_shard, _ = fully_shard_api()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif stack == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
        if "scale1" in variants and rank == 1:
            with torch.no_grad():
                model.model.layers[0].self_attn.q_proj.weight._local_tensor.mul_(1.001)
    return model


def parallel_model(stack, variants, rank):
    if "llama" in variants:
        return parallel_llama(stack, variants, rank)
    approximate = "tanh" if "tanh1" in variants and rank == 1 else "none"
    model = build(approximate, norm="adamwbn" in variants)
    if stack == "fsdp":
        fully_shard, policy_class = fully_shard_api()
        options = {"reshard_after_forward": "keep" not in variants}
        if "bf16" in variants:
            options["mp_policy"] = policy_class(param_dtype=torch.bfloat16)
        linears = [layer for layer in model if isinstance(layer, nn.Linear)]
        if "root" in variants:
            linears = []
        elif "block" in variants:  # the second Linear's parameters in the root's group
            linears = linears[:1]
        for layer in linears:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        if "scale1" in variants and rank == 1:
            with torch.no_grad():
                model[0].weight._local_tensor.mul_(1.001)
    elif stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif stack == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if "scale1" in variants and rank == 1:
            with torch.no_grad():
                model[0].weight._local_tensor.mul_(1.001)
        if "replica1" in variants and rank == 1:  # the replicated bias, on one rank only
            with torch.no_grad():
                model[2].bias._local_tensor.mul_(1.001)
    return model


class FaultyGroup:
    """A process group whose all-reduce result is scaled on this rank: a stand-in for a
    faulty collective (a bad link, a buggy reduction kernel). The scaling runs inside the
    collective, so capture sees the same inputs and a different output."""

    def __init__(self, group, factor):
        self.group, self.factor = group, factor

    def allreduce(self, tensors, options):
        work = self.group.allreduce(tensors, options)
        if self.factor != 1.0:
            work.wait()
            for tensor in tensors:
                tensor.mul_(self.factor)
        return work

    def __getattr__(self, name):
        return getattr(self.group, name)

    def __repr__(self):
        return "FaultyGroup"


def collective_losses(variants, rank, debugger):
    import torch.distributed as dist

    torch.manual_seed(0)
    layer = nn.Linear(IN, HIDDEN)
    group = FaultyGroup(dist.group.WORLD, 1.001 if "fault1" in variants and rank == 1 else 1.0)
    losses = []
    for x in batches(100 + rank):
        debugger.start(layer)
        with torch.no_grad():
            hidden = layer(x)
            dist.all_reduce(hidden, group=group)
            loss = hidden.tanh().mean()
        debugger.stop()
        debugger.step()
        losses.append(float(loss).hex())
    debugger.close()
    return losses


def backward_collective_losses(variants, rank, debugger):
    """A gradient all-reduced by a hook in backward, as a user's own data-parallel code does;
    fault1 scales rank 1's result inside the collective."""
    import torch.distributed as dist

    torch.manual_seed(0)
    layer = nn.Linear(IN, HIDDEN)
    group = FaultyGroup(dist.group.WORLD, 1.001 if "fault1" in variants and rank == 1 else 1.0)

    def reduce_gradient(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    losses = []
    for x in batches(100 + rank):
        debugger.start(layer)
        layer.zero_grad()
        hidden = layer(x)
        hidden.register_hook(reduce_gradient)
        loss = hidden.tanh().mean()
        loss.backward()
        debugger.stop()
        debugger.step()
        losses.append(float(loss).hex())
    debugger.close()
    return losses


def run_example(out_dir, scenario, variants, rank):
    """examples/distributed/train_fsdp2.py or train_tp.py for one step, as its main() runs
    it on a rank (the job's process group stands for the one main() starts)."""
    from examples.distributed import train_fsdp2, train_tp

    script, *options = variants
    argv = ["--dump", os.path.join(out_dir, scenario), "--steps", "1"]
    for option in options:
        argv += ["--bug-rank", option[len("bug"):]] if option.startswith("bug") else [f"--{option}"]
    example = train_fsdp2 if script == "fsdp2" else train_tp
    example.run(example.parse(argv), rank)


def run_scenario(out_dir, scenario, rank):
    stack, capture, *variants = scenario.split("-")
    if stack == "example":
        run_example(out_dir, scenario, [capture, *variants], rank)
        return
    debugger = debugger_for(capture, os.path.join(out_dir, scenario))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if stack == "coll":
            losses = collective_losses(variants, rank, debugger)
        elif stack == "bwcoll":
            losses = backward_collective_losses(variants, rank, debugger)
        else:
            model = parallel_model(stack, variants, rank)
            same_batch = stack in ("tp", "one") or "data" in variants
            seed = 100 if same_batch else 100 + rank
            if "llama" in variants:
                losses = train(model, llama_batches(seed), debugger, loss_of=llama_loss)
            else:
                xs = batches(seed)
                if "xgrad" in variants:  # tensor parallel then all-reduces the input's gradient
                    xs = [x.requires_grad_() for x in xs]
                losses = train(model, xs, debugger, adamw="adamwbn" in variants)
    with open(os.path.join(out_dir, f"{scenario}.rank{rank}.json"), "w") as out:
        json.dump(losses, out)
    with open(os.path.join(out_dir, f"{scenario}.rank{rank}.warnings.json"), "w") as out:
        json.dump([f"{type(w.message).__name__}: {w.message}" for w in caught
                   if str(w.message).startswith("probe:")], out)


def main(out_dir, scenarios):
    import torch.distributed as dist

    from tests.two_ranks import end_rank

    torch.set_num_threads(1)
    if "WORLD_SIZE" not in os.environ:  # plain python, not torchrun: one device (stack one)
        for scenario in scenarios:
            run_scenario(out_dir, scenario, 0)
        return
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for scenario in scenarios:
        run_scenario(out_dir, scenario, rank)
    end_rank()


def launch(out_dir, scenarios, timeout=300):
    """Run the scenarios in one 2-rank torchrun job; raise with its output when it fails."""
    from tests.two_ranks import launch as two_ranks

    return two_ranks(__file__, out_dir, scenarios, timeout)


def losses(out_dir, scenario, rank):
    with open(os.path.join(out_dir, f"{scenario}.rank{rank}.json")) as found:
        return json.load(found)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
