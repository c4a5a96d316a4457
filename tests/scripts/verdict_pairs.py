"""Write a reference run and a changed run of a tiny model, for the verdicts in docs/compare.md.

    python tests/scripts/verdict_pairs.py CASE OUT      # writes OUT/a and OUT/b
    probe compare OUT/a OUT/b [--replay]

CASE:
  weight        fc1.weight x 1.001 in B (task tensor): introduced at fc1's linear, replay agrees
  eps           LayerNorm eps 1e-3 in B (task tensor): arguments differ
  gelu          F.gelu(x) in A, F.gelu(x, approximate="tanh") in B (task tensor)
  fc1-bf16      B computes fc1 in bfloat16 by its own casts: a precision finding (exit 0)
  autocast      B runs under torch.autocast(bfloat16): PASS, with a note counting the ops
  fp64          B in float64: PASS, the dtypes listed under "the runs differ in"
  models        B is a conv net: the dumps look like different models
  drift         a small ResNet with AdamW, 1 thread in A and 2 in B, 5 steps: drift
  bf16-weight   a bf16 attention model, qkv.weight x 1.005 in B: the likely cause is the qkv
                linear, where the error entered within tolerance
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.real_models import TinyResNet, dump_run, resnet_batch  # noqa: E402
from tests.verdict_models import SmallNet, TinyAttention, scale_fc1_weight, tokens, train  # noqa: E402


def _scale_qkv(model):
    with torch.no_grad():
        model.qkv.weight.mul_(1.005)


def _conv_net():
    from tests.compare.test_compare_different_models import TinyConv

    return TinyConv()


def main(case: str, out: str) -> None:
    a, b = os.path.join(out, "a"), os.path.join(out, "b")
    if case == "weight":
        train(a), train(b, fault=scale_fc1_weight)
    elif case == "eps":
        train(a), train(b, lambda: SmallNet(eps=1e-3))
    elif case == "gelu":
        train(a), train(b, lambda: SmallNet(approximate="tanh"))
    elif case == "fc1-bf16":
        train(a), train(b, lambda: SmallNet(fc1_dtype=torch.bfloat16))
    elif case == "autocast":
        train(a), train(b, autocast=torch.bfloat16)
    elif case == "fp64":
        train(a), train(b, dtype=torch.float64)
    elif case == "models":
        train(a, level="module", task="statistics"), train(b, _conv_net, level="module", task="statistics")
    elif case == "drift":
        for path, threads in ((a, 1), (b, 2)):
            dump_run(path, lambda: TinyResNet(16), lambda: resnet_batch(16, 16), steps=5, n_threads=threads,
                     optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    elif case == "bf16-weight":
        options = dict(data=tokens, task="statistics", lr=1e-3, dtype=torch.bfloat16)
        train(a, lambda: TinyAttention(sharpness=8.0), **options)
        train(b, lambda: TinyAttention(sharpness=8.0), fault=_scale_qkv, **options)
    else:
        raise SystemExit(f"unknown case {case!r}; see the docstring")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
