"""probe.integrations.lightning.ProbeCallback with a compiled model in a LightningModule
(``self.net = torch.compile(self.net)``, backend aot_eager, CPU): captured from inside the
compiled graph, training bit-identical, two runs pass. So is ``trainer.fit(torch.compile(module))``,
where Lightning compiles that module's training_step and forward on the instance."""

import warnings

import pytest
import torch
from torch import nn

from tests.torch_versions import needs_compiled_capture, needs_plain_compile_taps

pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")

import probe  # noqa: E402
from examples.trainers.lightning_trainer import loader  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from probe.integrations.lightning import ProbeCallback  # noqa: E402

pytestmark = needs_compiled_capture()

#: the multiplier the marker passes to Tensor.mul, recorded as an argument
MARKER = "net.3/Tensor.mul#0/forward/input.1"


class DoubledWhenCompiled(nn.Module):
    """x * 2 in compiled code, x * 1 in eager code: its recorded multiplier says which ran."""

    def forward(self, x):
        return x * (2.0 if torch.compiler.is_compiling() else 1.0)


class CompiledRegressor(LightningModule):
    """The examples' regression MLP, its network compiled as Lightning's docs show for
    configure_model."""

    def __init__(self) -> None:
        super().__init__()
        net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(),
                            DoubledWhenCompiled(), nn.Linear(16, 1))
        self.net = torch.compile(net, backend="aot_eager")

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class LossRecorder(Callback):
    """Every training_step's loss as float.hex (bit-exact comparison)."""

    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]).hex())


def train(workdir, dump_path=None, module=None, steps=3):
    """(losses, graph breaks) of ``steps`` optimizer steps, captured at level mix into
    dump_path when given."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    recorder = LossRecorder()
    callbacks = [recorder]
    if dump_path is not None:
        callbacks.append(ProbeCallback({"dump_path": str(dump_path), "level": "mix",
                                        "overwrite": True}))
    torch.manual_seed(0)  # after the debugger seeded: both runs build the same weights
    trainer = Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(workdir),
                      callbacks=callbacks)
    trainer.fit(CompiledRegressor() if module is None else module, loader())
    return recorder.losses, sum(counters["graph_break"].values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_compiled")
    plain = train(root / "plain")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured = train(root / "trainer_a", root / "a")
    return root, plain, captured, [str(w.message) for w in caught]


@needs_plain_compile_taps()
def test_a_compiled_model_in_a_lightning_module_is_captured_from_inside_its_graph(runs):
    root, (_, plain_breaks), (_, captured_breaks), messages = runs
    assert not [m for m in messages if m.startswith("probe:")], messages
    assert captured_breaks == plain_breaks  # probe's hooks were not traced into the graph
    dump = probe.load(str(root / "a"))
    assert dump.steps == [0, 1, 2]
    records = {record["key"]: record for record in dump.records(step=1)}
    assert records[MARKER]["value"] == "2.0"  # the compiled code's multiplier, not eager's
    assert "net.0/functional.linear#0/forward/output.0" in records
    assert "net.1/functional.layer_norm#0/backward/grad_input.0" in records


def test_capturing_a_compiled_lightning_module_keeps_its_losses_bit_identical(runs):
    _, (plain_losses, _), (captured_losses, _), _ = runs
    assert len(plain_losses) == 3 and captured_losses == plain_losses


def test_two_identical_compiled_lightning_runs_compare_as_pass(runs):
    root, _, (losses_a, _), _ = runs
    losses_b, _ = train(root / "trainer_b", root / "b")
    assert losses_b == losses_a
    result = probe.compare(str(root / "a"), str(root / "b"))
    assert result.verdict == "pass" and result.counts["matched"] > 0


class WholeRegressor(CompiledRegressor):
    """The same module, its network left eager: trainer.fit gets torch.compile(module)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = self.net._orig_mod


@needs_plain_compile_taps()
def test_fitting_a_torch_compiled_lightning_module_is_captured_from_inside_its_graph(tmp_path):
    def fit_compiled(name, dump=None):
        torch.manual_seed(0)
        module = torch.compile(WholeRegressor(), backend="aot_eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome = train(tmp_path / name, dump and tmp_path / dump, module)
        return outcome, [str(w.message) for w in caught if str(w.message).startswith("probe:")]

    (plain_losses, plain_breaks), _ = fit_compiled("plain")
    (losses_a, breaks_a), messages = fit_compiled("trainer_a", "a")
    assert not messages, messages
    assert losses_a == plain_losses and breaks_a == plain_breaks
    records = {record["key"]: record for record in probe.load(str(tmp_path / "a")).records(step=1)}
    assert records[MARKER]["value"] == "2.0"  # recorded inside Lightning's compiled training_step
    assert "net.1/functional.layer_norm#0/backward/grad_input.0" in records
    (losses_b, _), _ = fit_compiled("trainer_b", "b")
    assert losses_b == losses_a
    assert probe.compare(str(tmp_path / "a"), str(tmp_path / "b")).verdict == "pass"
