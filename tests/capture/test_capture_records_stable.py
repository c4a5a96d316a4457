"""The records a capture makes stay exactly what they were: same rows, keys, order (seq),
slots, decisions and source lines, for small real models at each level.

The per-call path (capture/eager/api_mode.py, module_hooks.py, values.py, Recorder.add) is tuned
for speed (docs/performance.md); this test pins what it records against a stored expectation
(tests/data/capture_records.json): every column except the statistics, which depend on the
platform's kernels, with the source location as the text of the recorded line (so edits
elsewhere in a file do not move it). Autograd graphs differ between torch versions, so the
expectation is checked on the torch version it was written with (its major.minor).

Rewrite the expectation after an intended change of what is recorded:

    python tests/capture/test_capture_records_stable.py --write
"""

import json
import linecache
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))

from examples import models  # noqa: E402
from probe.config import Config  # noqa: E402
from probe.debugger.debugger import PrecisionDebugger  # noqa: E402
from probe.dump.reader import load  # noqa: E402

EXPECTED = os.path.join(HERE, "data", "capture_records.json")
#: stored per row, with the source line's text; module, op, index, phase and slot are
#: checked through the key they make up
COLUMNS = ("key", "seq", "kind", "io", "dtype", "shape", "value", "value_type")


class Edge(nn.Module):
    """One of each shape of call the per-call path handles differently."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.emb = nn.Embedding(10, 8)
        self.shared = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x, idx):
        h = self.fc(x) + self.emb(idx)
        h = h * h  # one tensor in two slots: one autograd edge
        h = F.normalize(h, dim=-1)  # composite, an input reaching two nodes
        a, b = torch.split(h, 4, dim=-1)  # tuple output, one node
        m = torch.max(a, dim=1)  # torch.return_types
        c = torch.cat([a, b * 2.0], dim=-1)  # a list input
        c = F.relu_(c.clone())  # in place
        c = c.contiguous()  # returns its input: no backward
        d = c.to(torch.float64).to(torch.float32)
        d = torch.where(d > 0, d, d * 0.1)
        d[:, 0] = m.values  # __setitem__ records the written tensor
        s = torch.stack([d, h], dim=0).sum(dim=0, keepdim=False)
        with torch.no_grad():
            s = s + torch.tanh(s)
        s = self.shared(self.shared(s))  # one module called twice
        s3 = F.linear(s.unsqueeze(1).expand(-1, 3, -1), self.fc.weight)  # composite linear
        s = self.norm(s + s3.mean(dim=1))
        return {"y": s.sum(-1), "aux": F.softplus(s, beta=2.0)}


def _edge_loss(x, idx):
    def loss(model):
        out = model(x, idx)
        return out["y"].sum() + out["aux"].mean()
    return loss


def _ce_loss(x, y):
    def loss(model):
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return loss


def _cases():
    """(name, model factory, loss factory, config) of every capture the expectation holds."""
    g = torch.Generator().manual_seed(1)
    xm, ym = torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
    xg, yg = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)
    xe = torch.randn(4, 8, generator=g).requires_grad_(True)  # a leaf input
    ie = torch.randint(0, 10, (4,), generator=g)
    return [
        ("mlp-module", lambda: models.MLP(16, 32, 4), _ce_loss(xm, ym), {"level": "module"}),
        ("deepmlp-mix", lambda: models.DeepMLP(16, 16, 1, 4), _ce_loss(xm, ym),
         {"level": "mix"}),
        ("gpt-api", lambda: models.TinyGPT(50, 16, 2, 1, 8), _ce_loss(xg, yg),
         {"level": "api"}),
        ("edge-api", Edge, _edge_loss(xe, ie), {"level": "api"}),
        ("edge-mix", Edge, _edge_loss(xe, ie), {"level": "mix"}),
        ("edge-list", Edge, _edge_loss(xe, ie),
         {"level": "mix", "list": ["functional.linear", "grad_input", "re:norm.*output"]}),
        ("edge-backward", Edge, _edge_loss(xe, ie), {"level": "mix", "data_mode": ["backward"]}),
    ]


def _source_text(source: str) -> str:
    """``file:line`` -> ``basename: text of the line`` (what the line says, not its number)."""
    if not source:
        return ""
    path, _, number = source.rpartition(":")
    text = linecache.getline(os.path.abspath(path), int(number)).strip()
    return f"{os.path.basename(path)}: {text}"


def _capture(folder, make_model, loss_of, config) -> list:
    """Rows of the second of two captured training steps (counters restart each step)."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    debugger = PrecisionDebugger(Config(dump_path=str(folder), **config))
    for _ in range(2):
        with debugger.capture(model):
            loss_of(model).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    debugger.close()
    rows = load(folder).records(step=1)
    for row in rows:
        assert row["key"] == "{module}/{op}#{index}/{phase}/{slot}".format(**row), row
    return [[row[column] for column in COLUMNS] + [_source_text(row["source"])] for row in rows]


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _all_records(folder) -> dict:
    return {name: _capture(os.path.join(folder, name), make, loss, config)
            for name, make, loss, config in _cases()}


def test_records_of_small_models_are_exactly_the_stored_ones(tmp_path):
    with open(EXPECTED, encoding="utf-8") as handle:
        expected = json.load(handle)
    if expected["torch"] != _torch_minor():
        pytest.skip(f"expectation written with torch {expected['torch']}, this is "
                    f"{_torch_minor()} (autograd graphs differ between versions)")
    got = _all_records(tmp_path)
    sources = expected["sources"]
    for name, rows in expected["cases"].items():
        want = [row[:-1] + [sources[row[-1]]] for row in rows]
        assert len(got[name]) == len(want), f"{name}: {len(got[name])} rows, expected {len(want)}"
        for position, (row, wanted) in enumerate(zip(got[name], want)):
            assert row == wanted, f"{name} row {position}: {row} != {wanted}"


def _write_expectation() -> None:
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        cases = _all_records(scratch)
    sources: dict = {}  # each line's text once; rows hold its number
    for rows in cases.values():
        for row in rows:
            row[-1] = sources.setdefault(row[-1], len(sources))
    with open(EXPECTED, "w", encoding="utf-8") as handle:
        handle.write('{"torch": %s,\n "sources": [\n' % json.dumps(_torch_minor()))
        handle.write(",\n".join("  " + json.dumps(text) for text in sources))
        handle.write('\n ],\n "cases": {\n')
        for number, (name, rows) in enumerate(cases.items()):
            handle.write("  %s: [\n" % json.dumps(name))
            handle.write(",\n".join("   " + json.dumps(row) for row in rows))
            handle.write("\n  ]%s\n" % ("," if number < len(cases) - 1 else ""))
        handle.write(" }}\n")
    print(f"wrote {EXPECTED}: " + ", ".join(f"{k} {len(v)}" for k, v in cases.items()))


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    _write_expectation()
