"""Rounding envelopes: pairs that differ by rounding only pass and say so; real faults, also
below the tolerance, are named at their op (docs/compare-rules.md, "Is this gap expected?")."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import probe
from probe.cli import main as cli
from probe.comparison import envelope as E
from probe.comparison import ops
from probe.comparison.op_envelopes import op_envelope
from tests import rounding_pairs as P
from tests.verdict_models import TinyAttention, tokens

ROUNDING_ONLY = "PASS: the runs differ by rounding only (largest difference "
STATISTICS = {"task": "statistics", "level": "mix"}


# ---------------------------------------------------------------------------- the model


def _operand(x, err=0.0):
    x = np.asarray(x, np.float64)
    return E.Operand(numel=x.size, norm=float(np.linalg.norm(x)), min=float(x.min()), max=float(x.max()),
                     mean=float(x.mean()), shape=x.shape, dtype="float32", err=err)


def _two_orders(x, w):
    """x @ w.T in float32 summed in two orders: numpy's, and K cut in three pieces added last first."""
    one = (x @ w.T).astype(np.float64)
    cuts = [0, x.shape[1] // 3 + 1, 2 * x.shape[1] // 3, x.shape[1]]
    parts = [(x[:, a:b] @ w[:, a:b].T) for a, b in zip(cuts, cuts[1:])]
    other = parts[2] + parts[1] + parts[0]
    return one, other.astype(np.float64)


@pytest.mark.parametrize("k", [16, 256, 4096])
def test_a_matmul_summed_in_another_order_stays_within_its_envelope_which_is_not_loose_beyond_sqrt_k(k):
    rng = np.random.default_rng(k)
    x = rng.standard_normal((32, k)).astype(np.float32)
    w = rng.standard_normal((24, k)).astype(np.float32)
    one, other = _two_orders(x, w)
    seen = float(np.linalg.norm(one - other))
    env = op_envelope(ops.spec("functional.linear"), "forward", "output.0", _operand(one), {"input.0": _operand(x),
                                                                                     "input.1": _operand(w)})
    assert env.family == ops.DOT and env.k == k and env.propagated == 0
    assert 0 < seen <= env.rounding
    # Higham-Mary's sqrt(K) u, and ||x|| ||W|| ~ sqrt(K) ||y|| for spread data: within K x 10 of what is seen
    assert env.rounding <= 10 * k * seen
    assert env.judge(seen, seen) == "within"


def test_a_sum_of_one_sign_is_well_conditioned_and_one_that_cancels_is_not():
    positive = np.abs(np.random.default_rng(1).standard_normal(10_000)) + 0.1
    mixed = positive * np.where(np.arange(10_000) % 2, 1.0, -1.0)
    env_pos = op_envelope(ops.spec("torch.sum"), "forward", "output.0", _operand([positive.sum()]),
                            {"input.0": _operand(positive)})
    env_mix = op_envelope(ops.spec("torch.sum"), "forward", "output.0", _operand([mixed.sum()]),
                            {"input.0": _operand(mixed)})
    assert env_pos.conditioning == pytest.approx(1.0)
    assert env_mix.conditioning > 100 * env_pos.conditioning


def test_a_division_by_values_near_zero_passes_its_inputs_differences_on_amplified():
    a, b = _operand(np.linspace(1, 2, 64), err=1e-6), _operand(np.linspace(1e-3, 1, 64), err=1e-9)
    far = op_envelope(ops.spec("Tensor.div"), "forward", "output.0", _operand(np.ones(64)), {"input.0": a, "input.1": _operand(
        np.linspace(1, 2, 64), err=1e-9)})
    near = op_envelope(ops.spec("Tensor.div"), "forward", "output.0", _operand(np.ones(64)), {"input.0": a, "input.1": b})
    assert near.propagated > 100 * far.propagated
    straddles = op_envelope(ops.spec("Tensor.div"), "forward", "output.0", _operand(np.ones(64)),
                              {"input.0": a, "input.1": _operand(np.linspace(-1, 1, 64), err=1e-9)})
    assert straddles.propagated == math.inf and straddles.judge(1.0, 1.0) == "unbounded"


def test_an_op_whose_own_error_exceeds_its_envelope_is_beyond_and_a_band_that_straddles_is_uncertain():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((16, 64)).astype(np.float32), rng.standard_normal((8, 64)).astype(np.float32)
    y = (x @ w.T).astype(np.float64)
    env = op_envelope(ops.spec("functional.linear"), "forward", "output.0", _operand(y), {"input.0": _operand(x),
                                                                                   "input.1": _operand(w)})
    wrong = float(np.linalg.norm(y * 1e-3))  # the op computed 0.1% off, its inputs equal
    assert env.judge(wrong, wrong) == "beyond"
    limit = E.FACTOR * env.rounding
    assert env.judge(0.5 * limit, 2 * limit) == "uncertain"
    assert env.judge(0.1 * limit, 0.5 * limit) == "within"


def test_an_embedding_gradient_summed_over_repeated_tokens_in_another_order_is_rounding_not_a_copy():
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 4, 64)  # 4 tokens, each repeated: their gradient rows are summed
    gy = rng.standard_normal((64, 16)).astype(np.float32)
    one = np.zeros((4, 16), np.float32)
    other = np.zeros((4, 16), np.float32)
    for i in range(64):
        one[ids[i]] += gy[i]
    for i in reversed(range(64)):
        other[ids[i]] += gy[i]
    seen = float(np.linalg.norm(one.astype(np.float64) - other))
    env = op_envelope(ops.spec("functional.embedding"), "backward", "grad_input.1", _operand(one),
                        {"grad_output.0": _operand(gy)}, {"input.0": _operand(ids), "input.1": _operand(one)})
    assert env.family == ops.SUM and env.k == 64 and env.rounding > 0
    assert 0 < seen and env.judge(seen, seen) == "within"


def test_an_exact_copy_that_differs_by_its_inputs_difference_and_a_hair_is_within_not_beyond():
    x = _operand(np.ones((8, 4)), err=1e-3)
    env = op_envelope(ops.spec("torch.cat"), "forward", "output.0", _operand(np.ones((16, 4))),
                        {"input.0.0": x, "input.0.1": x})
    assert env.rounding == 0
    assert env.judge(env.propagated * (1 + 1e-7), env.propagated * (1 + 1e-7)) == "within"
    assert env.judge(env.propagated * 1.01, env.propagated * 1.01) == "beyond"


def test_what_rounding_makes_is_never_given_as_a_ratio_to_nothing():
    assert E.expected_text(0.0, 3e-4) == "expected from rounding: none (it rounds nothing), seen: 3.00e-04"
    assert E.expected_text(2e-4, 1e-4).endswith("(0.5x)")


def test_the_rounding_headline_above_1x_says_it_is_within_the_margin_not_a_gap_beyond():
    from probe.comparison.result import headline

    summary = dict(rounding_only=True, largest_gap=1.2, uncertain=0, baseline=None)
    assert headline(summary) == ("the runs differ by rounding only (largest difference 1.2x what rounding makes, "
                                 "within the 2x margin an op's own rounding may take)")
    assert "its envelope" not in headline(dict(summary, largest_gap=0.5, baseline="c"))
    assert headline(dict(summary, largest_gap=400.0)).endswith(
        "(largest difference 4e+02x what rounding makes, its inputs' accepted differences explaining the rest "
        "(amplified rounding))")


def test_rsqrts_backward_scales_its_gradients_difference_by_its_derivative_at_small_variances():
    var = _operand(np.linspace(1e-4, 1.0, 32))
    gy = _operand(np.ones(32), err=1e-3)
    out = _operand(-0.5 * np.linspace(1e-4, 1.0, 32) ** -1.5)
    env = op_envelope(ops.spec("torch.rsqrt"), "backward", "grad_input.0", out, {"grad_output.0": gy}, {"input.0": var})
    # |d rsqrt(x)/dx| = 0.5 x^-1.5 reaches 5e5 at x = 1e-4: a gradient difference grows with it
    assert env.propagated >= 0.5 * 1e-4 ** -1.5 * 1e-3 * 0.99


# ---------------------------------------------------------------------------- pairs of runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Dumps made once: the deep LayerNorm/Linear/GELU stack with AdamW, 3 steps, plain on one
    thread; the same on two threads under other_rounding() (another device's summation order)."""
    root = tmp_path_factory.mktemp("envelope")
    made = {}

    def get(name, **options):
        if name not in made:
            made[name] = P.run(root / name, **options)
        return made[name]
    return get


@pytest.mark.parametrize("task", ["statistics", "tensor"])
def test_a_deep_stack_against_other_device_rounding_on_two_threads_passes_by_rounding_only(runs, task):
    a = runs(f"a-{task}", task=task, threads=1)
    b = runs(f"b-{task}", task=task, threads=2, perturb=True)
    result = probe.compare(a, b)
    headline = result.to_text().splitlines()[0]
    assert result.verdict == "pass" and headline.startswith(ROUNDING_ONLY), headline
    assert result.envelope["differ"] and result.envelope["beyond"] == 0 and result.envelope["largest_gap"] < 1
    strict = probe.compare(a, b, strict=True)
    assert not strict.to_text().startswith(ROUNDING_ONLY)  # --strict: the fixed tolerance alone


def _compare_cli(capsys, *argv):
    """(exit code, stdout) of ``probe compare ARGV``, run by the CLI's own entry point."""
    with pytest.raises(SystemExit) as exited:
        cli(["compare", *argv])
    return exited.value.code, capsys.readouterr().out


def test_the_cli_exits_0_with_the_rounding_headline_and_its_json_keeps_the_contract_with_envelopes(runs, capsys):
    a, b = runs("a-statistics", task="statistics", threads=1), runs("b-statistics", task="statistics", threads=2,
                                                                      perturb=True)
    code, text = _compare_cli(capsys, a, b)
    assert code == 0 and text.startswith(ROUNDING_ONLY)
    code, out = _compare_cli(capsys, a, b, "--json", "--rows")
    data = json.loads(out)
    assert code == 0 and data["verdict"] == "pass" and data["first_divergence"] is None
    assert {"matched", "only_a", "only_b", "diverged"} <= set(data["counts"])
    assert data["envelope"]["largest_gap"] < 1 and data["envelope"]["strict"] is False
    enveloped = [row["envelope"] for row in data["rows"] if row.get("envelope")]
    assert enveloped and all({"expected", "seen", "verdict", "text"} <= set(e) for e in enveloped)


@pytest.mark.parametrize("fault, module, op", [
    (P.eps_in_block(3), "blocks.3.ln", "functional.layer_norm"),
    (P.tanh_gelu, "", "functional.gelu"),
    (P.scale_weight(5), "blocks.5.fc", "functional.linear"),
], ids=["eps", "tanh-gelu", "weight-x1.001"])
def test_real_faults_in_the_same_pair_are_still_named_introduced_at_their_op(runs, tmp_path, fault, module, op):
    a = runs("a-statistics", task="statistics", threads=1)
    b = P.run(tmp_path / "b", task="statistics", steps=1, threads=2, perturb=True, fault=fault)
    result = probe.compare(a, b, steps=[0])
    cause = result.likely_cause
    assert result.verdict == "diverged" and (cause.module, cause.op, cause.origin) == (module, op, "introduced")


def test_a_softmax_cast_to_bf16_within_its_envelope_is_a_precision_finding_in_the_headline(runs, tmp_path):
    """One precision rule: the head's softmax in bfloat16 moves its values within bfloat16's
    rounding envelope: exit 0, and its cast is named in the headline."""
    a = runs("a-statistics", task="statistics", threads=1)
    b = P.run(tmp_path / "b", task="statistics", steps=1, threads=2, perturb=True, fault=P.softmax_in_bf16)
    result = probe.compare(a, b, steps=[0])
    headline = result.to_text().splitlines()[0]
    assert result.verdict == "pass" and result.likely_cause is None, headline
    assert "precision finding: B computes <root> Tensor.to in bfloat16 where A uses float32" in headline


def test_a_weight_scaled_below_the_tolerance_is_named_at_the_linear_that_reads_it(runs, tmp_path):
    a = runs("a-tensor", task="tensor", threads=1)
    b = P.run(tmp_path / "b", task="tensor", steps=1, perturb=True, fault=P.scale_weight(5, 1 + 1e-5))
    result = probe.compare(a, b, steps=[0])
    cause = result.likely_cause
    assert (cause.module, cause.op, cause.origin) == ("blocks.5.fc", "functional.linear", "introduced")
    assert "differs before anything computed it" in cause.cause and "expected from rounding" in cause.cause
    assert probe.compare(a, b, steps=[0], strict=True).verdict == "pass"  # 1e-5 is below rtol 2e-5


def test_fp32_against_bf16_autocast_with_a_minus_inf_causal_mask_passes_in_statistics(tmp_path):
    build = lambda: TinyAttention(attn="eager")  # noqa: E731
    a = P.run(tmp_path / "a", build, tokens, steps=1, task="statistics")
    b = P.run(tmp_path / "b", build, tokens, steps=1, task="statistics", autocast=torch.bfloat16)
    result = probe.compare(a, b)
    assert result.verdict == "pass", result.to_text()[:1500]
    mask = [row for row in result.rows if row.op == "Tensor.masked_fill" and row.slot == "output.0"]
    assert mask and all(row.status == "match" for row in mask)


@pytest.fixture(scope="module", params=["statistics", "tensor"])
def attention_kernels(request, tmp_path_factory):
    """A tiny bfloat16 Llama trained 2 steps twice, with eager attention and with sdpa: the same
    attention computed by two kernels, which round differently; AdamW carries it into step 1.
    (run options, eager dump, sdpa dump, their compare)"""
    from tests.real_models import hf_model, lm_loss, token_batch
    from tests.torch_versions import transformers_or_skip

    transformers_or_skip()

    root = tmp_path_factory.mktemp(f"kernels-{request.param}")
    options = dict(batch=token_batch, steps=2, task=request.param, dtype=torch.bfloat16, loss=lm_loss)
    eager = P.run(root / "eager", build=lambda: hf_model("llama", attn="eager"), **options)
    sdpa = P.run(root / "sdpa", build=lambda: hf_model("llama", attn="sdpa"), **options)
    return options, eager, sdpa, probe.compare(eager, sdpa)


def test_sdpa_against_eager_attention_in_bfloat16_over_two_steps_passes_by_rounding_only(attention_kernels, tmp_path):
    """sdpa fuses the attention, eager takes softmax of the scores: rounding only; a changed eps
    is still named."""
    from tests.real_models import hf_model

    options, eager, sdpa, result = attention_kernels
    assert result.verdict == "pass" and result.to_text().startswith(ROUNDING_ONLY), result.to_text()[:2000]
    assert probe.compare(eager, sdpa, strict=True).verdict == "diverged"  # the fixed tolerance alone: a false alarm

    def eps(model):
        model.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-2

    bug = P.run(tmp_path / "bug", build=lambda: hf_model("llama", attn="sdpa"), fault=eps, **options)
    cause = probe.compare(eager, bug).likely_cause
    assert (cause.module, cause.origin) == ("model.layers.1.post_attention_layernorm", "introduced")


def test_a_pass_by_rounding_leaves_no_op_summary_or_top_op_saying_diverged(attention_kernels):
    """The summaries are made from the rows after the last rule (the judge's, or drift within
    rounding settling the rows over steps): where the pair passes, no op summary, JSON top op
    or HTML top op says otherwise."""
    result = attention_kernels[3]
    assert result.verdict == "pass" and result.counts["diverged"] == 0
    assert [s.key for s in result.op_summaries if s.diverged] == []
    assert not [op for op in json.loads(result.to_json())["top_ops"] if op["diverged"] or op["origin"] == "introduced"]
    from probe.report import html_report

    table = html_report.render(result).split("Ops that add the most error")[1].split("</table>")[0]
    assert "introduced" not in table and "beyond tolerance" not in table, table


def _float32_rotary(model):
    """What transformers keeps in a bfloat16 model: the rotary inverse frequencies in float32."""
    rotary = model.model.rotary_emb
    width = 2 * rotary.inv_freq.numel()
    rotary.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, width, 2, dtype=torch.float32) / width))


def _bfloat16_rotary(model):
    _float32_rotary(model)
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to(torch.bfloat16)


def test_rotary_frequencies_held_in_bf16_in_a_bf16_llama_are_named_where_they_enter(tmp_path):
    """Below bfloat16's tolerance downstream (the cos/sin are rounded to bfloat16 anyway), and
    before, a pass by rounding only that said nothing: the first op that reads the buffer in
    another precision is named, a finding within bfloat16's envelope."""
    from tests.real_models import hf_model, lm_loss, token_batch

    options = dict(build=lambda: hf_model("llama"), batch=token_batch, steps=1, task="statistics",
                   dtype=torch.bfloat16, loss=lm_loss)
    a = P.run(tmp_path / "a", fault=_float32_rotary, **options)
    clean = P.run(tmp_path / "clean", perturb=True, fault=_float32_rotary, **options)
    b = P.run(tmp_path / "b", perturb=True, fault=_bfloat16_rotary, **options)
    assert probe.compare(a, clean).to_text().startswith(ROUNDING_ONLY)
    result = probe.compare(a, b)
    headline = result.to_text().splitlines()[0]
    # within bfloat16's envelope: a finding in the headline (exit 0), at the first op that reads
    # the buffer: its cast to float32 (transformers 5), or the indexing before it (transformers 4)
    assert result.verdict == "pass" and "; precision finding: B " in headline, headline
    assert "model.rotary_emb " in headline.split("precision finding:")[1] and "in bfloat16 where A" in headline


def test_one_mlp_gradient_scaled_by_1_003_in_a_bf16_llama_is_named_where_it_enters(tmp_path):
    """Below bfloat16's tolerance, against other-device rounding: the first op that reads the
    scaled gradient (the MLP's down projection, backward), introduced; the clean pair passes."""
    from tests.real_models import hf_model, lm_loss, token_batch

    options = dict(build=lambda: hf_model("llama"), batch=token_batch, steps=1, task="statistics",
                   dtype=torch.bfloat16, loss=lm_loss)
    a = P.run(tmp_path / "a", **options)
    clean = P.run(tmp_path / "clean", perturb=True, **options)
    b = P.run(tmp_path / "b", perturb=True, fault=P.scale_mlp_gradient(0, 1.003), **options)
    assert probe.compare(a, clean).to_text().startswith(ROUNDING_ONLY)
    result = probe.compare(a, b)
    cause = result.likely_cause
    assert (cause.module, cause.op, cause.phase, cause.origin) == (
        "model.layers.0.mlp.down_proj", "functional.linear", "backward", "introduced"), result.to_text()[:2000]
    assert "changed it in between" in cause.cause
    assert probe.compare(a, b, strict=True).verdict == "pass"  # the fixed tolerance alone misses it


def test_a_baseline_run_measures_the_envelopes_and_still_names_a_fault(runs, tmp_path):
    a = runs("a-statistics", task="statistics", threads=1)
    b = runs("b-statistics", task="statistics", threads=2, perturb=True)
    c = P.run(tmp_path / "c", task="statistics", perturb=True)
    result = probe.compare(a, b, baseline=c)
    assert result.verdict == "pass" and "what rounding makes as the baseline measured it" in result.to_text().splitlines()[0]
    bug = P.run(tmp_path / "bug", task="statistics", steps=1, perturb=True, fault=P.eps_in_block(3))
    cause = probe.compare(a, bug, baseline=c, steps=[0]).likely_cause
    assert (cause.module, cause.op, cause.origin) == ("blocks.3.ln", "functional.layer_norm", "introduced")


def test_probe_run_perturb_computes_the_command_with_other_device_rounding(tmp_path):
    script = tmp_path / "modes.py"
    script.write_text("import torch\nfrom torch.overrides import _get_current_function_mode_stack\n"
                      "print([type(m).__name__ for m in _get_current_function_mode_stack()])\n")
    plain = subprocess.run([sys.executable, "-m", "probe", "run", "-q", "--", sys.executable, str(script)],
                           capture_output=True, text=True)
    perturbed = subprocess.run([sys.executable, "-m", "probe", "run", "-q", "--perturb", "--", sys.executable,
                                str(script)], capture_output=True, text=True)
    assert plain.stdout.strip() == "[]" and perturbed.stdout.strip() == "['OtherRounding']", perturbed.stderr


def test_ppo_over_15_updates_each_dumped_against_other_device_rounding_passes_by_rounding_only(tmp_path):
    """The scenario probe exists for: PPO on CartPole trained twice, the second time with
    another device's rounding; every update step dumped."""
    pytest.importorskip("gymnasium", reason="the PPO example needs gymnasium: pip install -e '.[examples]'")
    from tests import ppo_runs

    def train(path, perturb):
        return ppo_runs.train(str(path), 15, other=perturb, config=STATISTICS, rollout_steps=32, epochs=1,
                              minibatch=32)

    assert train(tmp_path / "a", False) == train(tmp_path / "b", True)
    result = probe.compare(tmp_path / "a", tmp_path / "b")
    assert len(result.steps) == 15
    assert result.verdict == "pass" and result.to_text().startswith(ROUNDING_ONLY), result.to_text()[:1500]


def _policy_run(path, perturb, steps=14):
    """A tanh policy trained on a ratio of its new log-probabilities to those of a rollout made
    with the model outside the captured step (data the model makes: external inputs after step
    0), lr 0.1: its tanh units saturate; the second run under other_rounding() on 2 threads."""
    import contextlib

    from probe.perturb import other_rounding

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    debugger = probe.PrecisionDebugger({"task": "statistics", "level": "mix", "dump_path": str(path), "seed": 1})
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if perturb else 1)
    try:
        with other_rounding() if perturb else contextlib.nullcontext():
            for _ in range(steps):
                with torch.no_grad():
                    old = torch.log_softmax(model(x), -1)[:, 0]
                debugger.start(model)
                ratio = torch.exp(torch.log_softmax(model(x), -1)[:, 0] - old)
                loss = -(ratio * torch.linspace(-1, 1, 32)).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                debugger.stop()
                debugger.step()
    finally:
        torch.set_num_threads(threads)
        debugger.close()
    return str(path)


def test_a_saturating_tanh_policy_on_its_own_rollouts_against_other_device_rounding_passes(tmp_path):
    """tanh's backward computes 1 - y^2 from its output: near saturation it amplifies the
    output's accepted difference; and each step's rollout data is made from the model the
    previous steps accepted. Neither is an op introducing an error."""
    result = probe.compare(_policy_run(tmp_path / "a", False), _policy_run(tmp_path / "b", True))
    assert result.verdict == "pass" and result.to_text().startswith(ROUNDING_ONLY), result.to_text()[:1500]
