"""DDP under torchrun (2 ranks, gloo, CPU): per-rank dump files, the rank filter, collectives.

The test launches this very file once under ``python -m torch.distributed.run --standalone
--nproc_per_node 2`` (localhost only). Run as a script with config paths, it is one rank of a
tiny DDP job that calls all_reduce and broadcast explicitly inside the captured step, trained
once per config (one launch for every dump the tests need: each launch costs seconds).

The rank script ends with os._exit(0) once its output is flushed: gloo's worker threads can
outlive destroy_process_group() when a DDP model exists, and one of them then frees a tensor
while the interpreter finalizes ("terminate called without an active exception", SIGABRT;
2 of 30 runs of a 10-line DDP + broadcast script without probe). docs/howto.md tells torchrun
users the same.
"""

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD_SIZE = 2
STEPS = 2


def _run_rank(config_paths):
    """One rank of the DDP job, trained once per config (executed by torchrun, not by pytest)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import probe
    from examples.models import MLP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for config_path in config_paths:
        debugger = probe.PrecisionDebugger(probe.load_config(config_path))
        model = DistributedDataParallel(MLP(in_features=8, hidden=16, out_features=4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            x = torch.randn(4, 8, generator=data)
            debugger.start(model)
            optimizer.zero_grad()
            model(x).square().mean().backward()
            # A rank-dependent tensor: after all_reduce every rank holds 0 + 1 = 1 everywhere,
            # after the broadcast from rank 0 every rank holds rank 0's 10.
            summed = torch.full((3,), float(rank))
            dist.all_reduce(summed)
            token = torch.full((3,), 10.0 if rank == 0 else -1.0)
            dist.broadcast(token, src=0)
            optimizer.step()
            debugger.stop()
            debugger.step()
        debugger.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalization: see the module docstring


def _torchrun(tmp_path, configs):
    """Launch the 2-rank job once, training once per {name: config}.

    Returns ({name: dump path}, what the job printed on stderr)."""
    dumps, paths = {}, []
    for name, config in configs.items():
        dumps[name] = tmp_path / name
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"dump_path": str(dumps[name]), "level": "mix", **config}))
    # One thread per rank: the two ranks share the machine's cores.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(WORLD_SIZE), os.path.abspath(__file__), *map(str, paths)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout}\n{done.stderr}"
    return dumps, done.stderr


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    return _torchrun(tmp_path_factory.mktemp("ddp"), {"all_ranks": {"rank": []}, "rank1_only": {"rank": [1]}})


@pytest.fixture(scope="module")
def all_ranks_dump(ddp_job):
    return ddp_job[0]["all_ranks"]


@pytest.fixture(scope="module")
def rank1_dump(ddp_job):
    return ddp_job[0]["rank1_only"]


def _files(dump):
    return sorted(
        f"{step_dir}/{name}"
        for step_dir in os.listdir(dump)
        for name in os.listdir(dump / step_dir)
    )


def test_each_rank_writes_its_own_step_file(all_ranks_dump):
    from probe.dump.reader import load

    expected = [f"step{s}/rank{r}.h5" for s in range(STEPS) for r in range(WORLD_SIZE)]
    assert _files(all_ranks_dump) == expected
    dump = load(all_ranks_dump)
    for step in range(STEPS):
        for rank in range(WORLD_SIZE):
            with dump.open(step, rank) as step_file:
                assert (step_file.step, step_file.rank) == (step, rank)
                assert step_file.attrs["world_size"] == WORLD_SIZE
                assert len(step_file.records) > 0


def test_ranks_record_their_own_data(all_ranks_dump):
    """The two ranks see different inputs, so their first module input statistics differ."""
    from probe.dump.reader import load

    dump = load(all_ranks_dump)
    means = []
    for rank in range(WORLD_SIZE):
        rows = [row for row in dump.records(step=0, rank=rank)
                if row["kind"] == "module" and row["phase"] == "forward" and row["io"] == "in"]
        assert rows, f"rank {rank} recorded no module inputs"
        means.append(min(rows, key=lambda row: row["seq"])["mean"])
    assert means[0] != means[1]


def test_rank_filter_writes_only_the_selected_rank(rank1_dump):
    assert _files(rank1_dump) == [f"step{s}/rank1.h5" for s in range(STEPS)]


@pytest.mark.parametrize("collective, value", [("all_reduce", 1.0), ("broadcast", 10.0)])
def test_collective_calls_are_captured_with_their_result_or_warned_about(ddp_job, collective,
                                                                         value):
    """Each rank's dump holds the collective call; its output is the post-collective value.
    Where this torch hides the collective from a TorchFunctionMode, each rank says so once."""
    from probe.dump.reader import load
    from torch_versions import collectives_this_torch_hides

    dumps, printed = ddp_job
    dump = load(dumps["all_ranks"])
    warnings = [line for line in printed.splitlines()
                if "TorchVersionWarning" in line and "__torch_function__" in line]
    if collective in collectives_this_torch_hides():
        # once per rank: probe warns once per process group (the second config's debugger
        # adds nothing)
        assert len(warnings) == WORLD_SIZE, printed
        assert all(collective in line or "any collective" in line for line in warnings)
        for rank in range(WORLD_SIZE):
            assert not any(collective in row["op"] for row in dump.records(step=0, rank=rank))
        return
    for rank in range(WORLD_SIZE):
        rows = [row for row in dump.records(step=0, rank=rank) if collective in row["op"]]
        assert rows, (f"rank {rank}: no record whose op mentions {collective!r}; ops seen: "
                      f"{sorted({row['op'] for row in dump.records(step=0, rank=rank)})}")
        outputs = [row for row in rows if row["io"] == "out" and row["numel"] == 3]
        assert outputs, f"rank {rank}: {collective} recorded no output tensor: {rows}"
        assert all(row["min"] == row["max"] == value for row in outputs), outputs


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    _run_rank(sys.argv[1:])
