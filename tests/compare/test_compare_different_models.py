"""Two dumps of unrelated models are called so, with their share of module paths in common."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import probe
from probe.comparison.load import overlap
from tests.verdict_models import SmallNet, train


class TinyConv(nn.Module):
    """A conv net over the same (8, 16) batch, seen as a 1-channel signal."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.stem(x.unsqueeze(1)))).flatten(1))


def test_a_conv_net_against_a_linear_net_says_they_look_like_different_models(tmp_path):
    a = train(tmp_path / "a", level="module", task="statistics")
    b = train(tmp_path / "b", TinyConv, level="module", task="statistics")
    result = probe.compare(a, b)
    notes = [note for note in result.notes if note.startswith("A and B look like different models")]
    assert notes and "% of module paths in common" in notes[0]
    assert "A and B look like different models" in result.to_text()


def test_the_same_model_with_a_fault_is_not_called_a_different_model(tmp_path):
    a = train(tmp_path / "a", level="module", task="statistics")
    b = train(tmp_path / "b", lambda: SmallNet(eps=1e-3), level="module", task="statistics")
    result = probe.compare(a, b)
    assert not any("different models" in note for note in result.notes)


def test_the_share_counts_every_level_of_the_module_paths():
    assert overlap(["blocks.0.fc", "blocks.1.fc"], ["blocks.0.fc", "blocks.1.fc"]) == 1.0
    # stem, bn, head against fc1, ln, fc2, head: 1 of 6 paths in common
    assert abs(overlap(["stem", "bn", "head"], ["fc1", "ln", "fc2", "head"]) - 1 / 6) < 1e-12
    assert overlap(["", ""], ["fc"]) is None
