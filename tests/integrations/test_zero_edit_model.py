"""Which module zero-edit capture takes as the model (probe/autoattach/choose_model.py): the
smallest module owning every parameter the optimizer holds, ``--model CLASS`` when the user
names one, and a warning saying how to name one when no module owns them all."""

import json
import warnings

import pytest
import torch
from torch import nn

import probe
from probe.fingerprint.file import read as read_fingerprints


@pytest.fixture
def attach(tmp_path, monkeypatch):
    """attach(config keys, model_class=None): automatic capture in this process, as the
    start-up hook attaches it; stood down after the test."""
    from probe.autoattach import session

    made = []

    def start(keys: dict, model_class: str | None = None):
        (tmp_path / "cfg.json").write_text(json.dumps({"dump_path": str(tmp_path / "dump"), **keys}))
        for name in ("PROBE_SEED", "PROBE_COMMAND", "PROBE_NOTES"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("PROBE_ATTACH", "1")
        monkeypatch.setenv("PROBE_CONFIG", str(tmp_path / "cfg.json"))
        if model_class:
            monkeypatch.setenv("PROBE_MODEL", model_class)
        else:
            monkeypatch.delenv("PROBE_MODEL", raising=False)
        made.append(session.attach())
        return made[-1]

    yield start
    for capture in made:
        if session.current() is capture:
            capture.stand_down()


def test_a_ppo_policy_trained_through_evaluate_actions_is_the_model(attach, tmp_path):
    """stable-baselines3 trains through policy.evaluate_actions: the first module trained
    is mlp_extractor, while Adam holds the policy's heads too. The policy is the model, so
    the heads keep their names in the fingerprints and the step file."""
    sb3 = pytest.importorskip("stable_baselines3", reason="pip install stable-baselines3 gymnasium")
    torch.manual_seed(0)
    agent = sb3.PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, n_epochs=1, seed=0,
                    policy_kwargs={"net_arch": [8]}, device="cpu")
    capture = attach({"level": "mix", "fingerprint": True, "step": [0]})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no warning of probe's: the choice is sure
        agent.learn(total_timesteps=64)
    capture.stand_down()
    assert capture.model is agent.policy and capture.entry is agent.policy.mlp_extractor
    names = [entry["name"] for entry in read_fingerprints(str(tmp_path / "dump" / "fingerprints" /
                                                               "rank0.h5")).tensors]
    assert "grad/action_net.weight" in names and "param/value_net.bias" in names
    assert not [name for name in names if "opt0.param" in name]
    records = probe.load(str(tmp_path / "dump")).records(step=0)
    linear = {record["module"] for record in records if record["op"] == "functional.linear"}
    assert linear == {"mlp_extractor.policy_net.0", "mlp_extractor.value_net.0", "action_net",
                      "value_net"}
    forward_of_entry = {record["slot"] for record in records
                        if record["module"] == "mlp_extractor" and record["phase"] == "forward"}
    assert {"input.0", "output.0"} <= forward_of_entry  # the call the step began in


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def test_model_class_names_the_model_when_the_first_module_trained_owns_every_parameter(attach, tmp_path):
    torch.manual_seed(0)
    outer = Outer()
    optimizer = torch.optim.SGD(outer.parameters(), lr=0.1)
    capture = attach({"level": "module"}, model_class="Outer")
    for _ in range(2):
        outer.net(torch.randn(2, 4)).sum().backward()  # training code calls a part, not forward
        optimizer.step()
    capture.stand_down()
    assert capture.model is outer
    modules = {record["module"] for record in probe.load(str(tmp_path / "dump")).records(step=1)}
    assert {"net", "net.0", "net.2"} <= modules


def test_an_optimizer_no_single_module_owns_is_warned_with_how_to_name_the_model(attach):
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 1)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    capture = attach({"level": "module"})
    with pytest.warns(RuntimeWarning, match="no module alive at the first training forward owns "
                                            "them all") as caught:
        for _ in range(2):
            second(first(torch.randn(2, 4))).sum().backward()
            optimizer.step()
    capture.stand_down()
    assert capture.model is first
    message = next(str(w.message) for w in caught if "owns them all" in str(w.message))
    assert "SGD holds 2 parameters the captured model (Linear) does not own" in message
    assert "`probe run --model CLASS`" in message
