"""A test script run as one 2-rank torchrun job on the CPU (gloo), and how each rank ends.

The scripts (tests/scripts/sharded_train.py, tests/integrations/sharded_trainer.py) take
``OUT_DIR NAME...`` and write what the tests read under OUT_DIR.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(script, out_dir, names, timeout=300):
    """Run ``script OUT_DIR NAME...`` under torchrun with 2 ranks, one intra-op thread each
    (the ranks share the machine's cores) and the repository importable; raise with the job's
    output when it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", os.path.abspath(script), str(out_dir), *names]
    done = subprocess.run(command, env=env, cwd=out_dir, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done


def end_rank():
    """End a rank's process once every rank is done and its output is flushed: gloo's worker
    threads can outlive destroy_process_group() and abort the interpreter's exit."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
