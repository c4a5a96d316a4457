"""``torchrun --nnodes M --nproc_per_node N -m probe compare A B``: one compare, its units split
over every process torchrun started, on one machine or many.

torchrun (torch.distributed's launcher, which users of distributed training already run)
starts the processes and says who they are (RANK, WORLD_SIZE, MASTER_ADDR in the
environment); each one opens the same dumps (a shared file system, or the same paths on
every machine), plans the same units and takes its share: the chains of units
(comparison/load.py UnitPlan.chains), longest first, each to the process with the fewest
units so far, so every process computes the same split without a word. It compares its
units one after the other and merges their summaries; then each process sends its summary
(wire.py: bytes in a uint8 tensor, read back by a reader that makes only a summary's
classes) to rank 0 over gloo, and rank 0 merges them one at a time, finishes the compare and
prints the report. The other ranks print nothing on stdout. Every process exits with rank 0's
exit code (0, 1 or 2); torchrun itself turns a non-zero one into its own failure report and
exit code 1.

torch is imported here, when a compare runs under torchrun; probe.comparison stays torch-free.
"""

from __future__ import annotations

import os

from probe.comparison.api import CompareJob, Context, run_units
from probe.comparison.summary import Partial, kept_cutoff
from probe.errors import CompareError
from probe.parallel import wire
from probe.parallel.ctrl_c import RememberedCtrlC


def under_torchrun() -> bool:
    """This process is one of several that torchrun (or another torch.distributed launcher) started."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def share(chains: list, world: int) -> list[list]:
    """The chains (lists of unit numbers) each process compares: the longest first, each to the
    process with the fewest units so far (the lowest rank on a tie)."""
    shares: list[list] = [[] for _ in range(world)]
    load = [0] * world
    for chain in sorted(chains, key=len, reverse=True):
        rank = min(range(world), key=lambda number: (load[number], number))
        shares[rank].append(chain)
        load[rank] += len(chain)
    return shares


class TorchrunRunner:
    """api.compare's runner under torchrun: rank 0 returns the merged Partial, the others None."""

    def __init__(self):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.finishes = self.rank == 0  # rank 0 finishes the compare and prints the report
        self.done = 0
        self.total = 0

    def __call__(self, job: CompareJob, context: Context, progress=None) -> Partial | None:
        numbers = [number for chain in share(context.plan.chains(), self.world)[self.rank] for number in chain]
        self.total = len(numbers)

        def report(fraction, read):
            RememberedCtrlC.check()  # a Ctrl-C Python dropped while the dumps were read
            self.done = int(fraction * self.total)
            if progress is not None:
                progress(fraction, read)

        return self._gather(run_units(job, context, report, numbers))

    def _gather(self, partial: Partial) -> Partial | None:
        """Every process's Partial merged on rank 0, one message at a time. Each first leaves
        out the kept rows the merge would drop (summary.kept_cutoff): every process keeps its
        first pair, and rank 0 would decode a pair's rows a process to keep one of them."""
        told = wire.encode((partial.kept_sizes(), partial.cutoff))
        if self.rank != 0:
            self._send(told)
            partial.leave_out_from(wire.decode(self._broadcast(None)))
            self._send(wire.encode(partial))
            return None
        everyone = [wire.decode(told)] + [wire.decode(self._receive(rank)) for rank in range(1, self.world)]
        left_out = kept_cutoff([size for sizes, _ in everyone for size in sizes], partial.budget,
                               *(cutoff for _, cutoff in everyone))
        self._broadcast(wire.encode(left_out))
        partial.leave_out_from(left_out)
        for rank in range(1, self.world):
            partial.merge(wire.decode(self._receive(rank)))
        return partial

    def _send(self, payload: bytes) -> None:
        import torch
        import torch.distributed as dist

        dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst=0)
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=0)

    def _broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0's payload, on every process (the others pass None)."""
        import torch
        import torch.distributed as dist

        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
                else torch.empty(int(size.item()), dtype=torch.uint8))
        dist.broadcast(data, src=0)
        return data.numpy().tobytes()

    def _receive(self, rank: int) -> bytes:
        """On rank 0: the next message of process rank."""
        import torch
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        try:
            dist.recv(size, src=rank)
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(payload, src=rank)
        except RuntimeError as error:  # gloo: the peer's connection closed
            raise CompareError(f"compare process {rank} of {self.world} stopped before sending its summary "
                               f"({' '.join(str(error).split())[:200]}); its own output says why") from None
        return payload.numpy().tobytes()

    def share_exit(self, code: int | None) -> int:
        """Rank 0's exit code, on every process; the process group ends here."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([code if code is not None else 0], dtype=torch.int64)
        dist.broadcast(value, src=0)
        dist.destroy_process_group()
        return int(value.item())
