"""What a test module, or an example run in the test's process, can leave behind for what runs
next in the same process, saved and put back."""

import os
import sys
import warnings


def save():
    """What one test module can leave behind for the next in the same process: environment
    variables, the working directory, warning filters and torch's global settings."""
    state = {"environ": dict(os.environ), "cwd": os.getcwd(), "warnings": list(warnings.filters)}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = (torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled(),
                          torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled())
    return state


def restore(state):
    if os.environ != state["environ"]:
        os.environ.clear()
        os.environ.update(state["environ"])
    if os.getcwd() != state["cwd"]:
        os.chdir(state["cwd"])
    warnings.filters[:] = state["warnings"]
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in state:
        dtype, threads, grad, deterministic, warn_only = state["torch"]
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:
        # a transformers Trainer leaves its accelerator settings (torch_compile=True: a dynamo
        # backend) in accelerate's process-wide state, and every later Accelerator inherits them
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate_state.GradientState._reset_state()
