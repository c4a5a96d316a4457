"""What each torch version can and cannot do, as measured by hand: the independent
expectations tests hold probe's run-time checks (probe/compat/) against."""

import torch

VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

#: every collective probe.compat probes
ALL_COLLECTIVES = frozenset({
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send",
    "recv", "isend", "irecv", "all_reduce_coalesced", "all_gather_coalesced",
})
#: the only collectives torch 2.7-2.11 passes through __torch_function__
PASSED_FROM_2_7 = frozenset({"all_reduce", "all_gather", "all_gather_into_tensor",
                             "reduce_scatter_tensor", "all_to_all_single"})


def collectives_this_torch_hides() -> frozenset:
    """Collectives a TorchFunctionMode never sees on this torch (measured on 2.4.1, 2.8.0,
    2.11.0, 2.12.0, 2.13.0 and 2.15.0; none reach it up to 2.6, all from 2.12)."""
    if VERSION < (2, 7):
        return ALL_COLLECTIVES
    if VERSION < (2, 12):
        return ALL_COLLECTIVES - PASSED_FROM_2_7
    return frozenset()


def lacks_dtype(name: str) -> str | None:
    """A skip reason when this torch has no torch.<name> (float8_e8m0fnu came in 2.7,
    float4_e2m1fn_x2 in 2.8), else None."""
    if isinstance(getattr(torch, name, None), torch.dtype):
        return None
    return f"torch {torch.__version__} has no dtype {name}"


def transformers_gap() -> str | None:
    """Why transformers cannot run here, else None: not installed (`pip install -e
    '.[models]'`), or installed in a version that disabled its torch backend for this torch
    (transformers 5 needs torch >= 2.6; `make setup` installs 4.x there, see
    scripts/torch_pins.py)."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed: pip install -e '.[models]'"
    if not transformers.utils.is_torch_available():
        return (f"transformers {transformers.__version__} does not support torch "
                f"{torch.__version__} (it disabled its torch backend)")
    return None


def transformers_or_skip():
    """transformers, or a skip that says why (transformers_gap). Works inside a test and at a
    test module's top level."""
    import pytest

    gap = transformers_gap()
    if gap is not None:
        pytest.skip(gap, allow_module_level=True)
    import transformers

    return transformers


def litgpt_or_skip():
    """litgpt, or a skip that says why it is missing. ``make setup`` installs it only with torch
    >= 2.7: below that pip finds an old litgpt that downgrades numpy and lightning (Makefile,
    litgpt-into-venv)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("litgpt") is None:
        below = VERSION < (2, 7)
        why = (f"torch {torch.__version__}: make setup installs litgpt only with torch >= 2.7 (an older "
               "litgpt would downgrade numpy and lightning)" if below else
               "litgpt is not installed (make setup installs it; or pip install litgpt)")
        pytest.skip(why)
    import litgpt

    return litgpt


def sharding_or_skip():
    """Skip (with the reason) where this torch cannot run the sharded tests: no
    torch.distributed, no FSDP2 fully_shard (torch.distributed.fsdp from 2.6,
    torch.distributed._composable.fsdp before), or no tensor-parallel API."""
    import pytest
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip(f"torch {torch.__version__} was built without torch.distributed")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard  # noqa: F401
        except ImportError:
            pytest.skip(f"torch {torch.__version__} has no FSDP2 fully_shard")
    try:
        from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.tensor.parallel")


def dynamo_breaks_tiny_llama() -> str | None:
    """A skip reason where torch.compile itself, without probe, breaks the graph of the tiny
    transformers llama (tests/real_models.py), else None. Measured: torch 2.4.1 with
    transformers 4.57.6 breaks it 8 times (its attention-mask registry, ModelOutput classes,
    OrderedDict.__setitem__), 2.8.0 with transformers 5.24 5 times (the iterator of
    transformers' _PerLayerConfigView); 2.12.0, 2.13.0 and 2.15.0 with 5.24 not at all."""
    if VERSION >= (2, 12):
        return None
    return (f"torch {torch.__version__}'s dynamo breaks the graph of transformers' llama "
            "without probe (measured on 2.4.1 and 2.8.0; no break from 2.12)")


def fsdp2_on_cpu_gap() -> str | None:
    """Why FSDP2 (fully_shard) cannot train on CPU with gloo on this torch, else None.
    Measured: on 2.4.1 the forward of a fully_shard-ed model calls CUDA; 2.8.0 on runs."""
    if VERSION < (2, 8):
        return (f"FSDP2 on CPU needs torch >= 2.8: on torch {torch.__version__} fully_shard's "
                "forward calls CUDA (CUDA driver version is insufficient), measured on 2.4.1")
    return None


def fsdp2_trains_like_ddp_or_skip():
    """Skip where FSDP2 on CPU does not train like DDP on the same data: on 2.8.0 FSDP2 with
    gloo sums the ranks' gradients where DDP averages them (the sharded gradients' norm is
    about twice DDP's, the losses part from step 1, without probe); alike on 2.10.0 and from
    2.12 (2.9 and 2.11 not measured; 2.11 is taken to be alike, 2.9 is skipped)."""
    import pytest

    if fsdp2_on_cpu_gap():
        pytest.skip(fsdp2_on_cpu_gap())
    if VERSION < (2, 10):
        pytest.skip(f"on torch {torch.__version__} FSDP2 on CPU with gloo sums the ranks' "
                    "gradients where DDP averages them (losses differ from step 1 without "
                    "probe), so the two do not train alike; measured on 2.8.0, alike from 2.10")


def functional_collective_wait_or_skip():
    """Skip where the wait of a functional collective (tensor parallel's all_reduce through
    torch.ops._c10d_functional) never reaches a TorchFunctionMode: measured on 2.4.1 and 2.8.0
    and 2.10.0 (the all_reduce is seen, its wait_tensor / _wrap_tensor_autograd not); seen
    from 2.12."""
    import pytest

    if VERSION < (2, 12):
        pytest.skip(f"on torch {torch.__version__} the wait of a functional collective does not "
                    "reach __torch_function__, so its result is not recorded (measured on "
                    "2.4.1, 2.8.0 and 2.10.0; recorded from 2.12)")


def dynamo_breaks_at_graph_marks() -> str | None:
    """A skip reason where probe.compile leaves its graph marks off because dynamo cuts the
    graph at them (measured on 2.4.1, with inlining on: one graph per submodule call), else
    None (2.8.0, 2.12.0, 2.13.0 and 2.15.0 trace them into one graph)."""
    if VERSION >= (2, 5):
        return None
    return (f"torch {torch.__version__}'s dynamo breaks the graph at probe's graph marks "
            "(measured on 2.4.1), so submodule arguments inside a graph keep the one-input/"
            "one-output rule there")


def needs_compiled_capture():
    """The skip marker of the compiled-capture tests: on a torch that lacks what capturing a
    compiled model needs (probe.compat.version_gaps.compiled_capture_gap), they skip naming what is missing."""
    import pytest
    from probe.compat import version_gaps

    gap = version_gaps.compiled_capture_gap()
    return pytest.mark.skipif(gap is not None, reason=str(gap))


def plain_compile_has_taps() -> bool:
    """Whether a plain torch.compile'd region gets graph taps under capture (region_taps.py):
    torch 2.4's dynamo does not inline torch.nn modules, so there its regions keep their
    boundary records only and compile once (measured on 2.4.1; taps from 2.5)."""
    return VERSION >= (2, 5)


def needs_plain_compile_taps():
    """The skip marker of the tests of graph taps in a plain torch.compile'd region."""
    import pytest

    return pytest.mark.skipif(
        not plain_compile_has_taps(),
        reason=f"torch {torch.__version__}'s dynamo does not inline torch.nn modules: a plain "
               "torch.compile'd region keeps its boundary records (docs/torch-versions.md)")


def tensor_parallel_reduction_gap() -> str | None:
    """A skip reason where capture does not record the all-reduce tensor parallel makes of a
    row-parallel Linear's partial sums (no collective reaches a TorchFunctionMode up to 2.6:
    collectives_this_torch_hides; measured on 2.4.1), so that Linear's output stays rank-local
    and one device's cannot pair with it; else None (recorded on 2.13.0 and 2.15.0)."""
    if "all_reduce" not in collectives_this_torch_hides():
        return None
    return (f"torch {torch.__version__} does not let capture record tensor parallel's all-reduce of a "
            "row-parallel Linear's partial sums (measured on 2.4.1): its output stays rank-local")


def compiled_trainer_gap() -> str | None:
    """A skip reason where dynamo cannot compile the transformers Trainer's model at all (torch
    2.4.1 with transformers 4.x: its causal-mask code fails in dynamo, without probe), else None
    (2.13.0 and 2.15.0 compile it)."""
    if VERSION >= (2, 5):
        return None
    return (f"torch {torch.__version__}'s dynamo fails on transformers' causal-mask code "
            "(masking_utils, without probe; measured on 2.4.1)")

