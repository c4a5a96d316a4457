"""Per-dtype tolerances: which side decides, defaults, and the override precedence."""

import pytest

from probe.comparison.tolerances import DEFAULTS, Tolerance, Tolerances, parse_tol_option, tolerance_dtype
from probe.errors import ConfigError


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ("float32", "bfloat16", "bfloat16"),
        ("bfloat16", "float32", "bfloat16"),
        ("float16", "bfloat16", "bfloat16"),
        ("float64", "float32", "float32"),
        ("float8_e4m3fn", "bfloat16", "float8_e4m3fn"),
        ("int64", "float32", "float32"),
        ("int64", "int64", "exact"),
        ("bool", "bool", "exact"),
        ("complex64", "complex64", "float32"),
        ("complex128", "float64", "float64"),
    ],
)
def test_the_lower_precision_side_decides_the_tolerance(a, b, expected):
    assert tolerance_dtype(a, b) == expected


def test_default_tolerances_grow_as_precision_falls():
    order = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn"]
    rtols = [DEFAULTS[name].rtol for name in order]
    assert rtols == sorted(rtols) and len(set(rtols)) == len(rtols)
    assert DEFAULTS["exact"] == Tolerance(0.0, 0.0)


def test_budget_is_rtol_times_reference_norm_plus_atol_times_root_n():
    tol = Tolerance(rtol=1e-3, atol=1e-6)
    assert tol.budget(10.0, 400) == pytest.approx(1e-2 + 2e-5)


def test_rtol_atol_override_every_float_dtype_and_tol_beats_them(tmp_path):
    table = Tolerances.build(rtol=0.5, atol=0.25, per_dtype=["bfloat16=1e-2,1e-5"])
    assert table.table["float32"] == Tolerance(0.5, 0.25)
    assert table.table["bfloat16"] == Tolerance(1e-2, 1e-5)
    assert table.table["exact"] == Tolerance(0.0, 0.0)


def test_tolerance_file_is_read_and_command_line_entries_win(tmp_path):
    path = tmp_path / "tol.yaml"
    path.write_text("float32: {rtol: 1.0e-3, atol: 1.0e-7}\nfloat16: [0.01, 0.001]\n")
    table = Tolerances.build(tol_file=str(path), per_dtype=["float16=0.1,0.2"])
    assert table.table["float32"] == Tolerance(1e-3, 1e-7)
    assert table.table["float16"] == Tolerance(0.1, 0.2)
    nested = tmp_path / "nested.yaml"
    nested.write_text("tolerances:\n  bfloat16: {rtol: 0.02}\n")
    assert Tolerances.build(tol_file=str(nested)).table["bfloat16"] == Tolerance(0.02, DEFAULTS["bfloat16"].atol)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("bfloat16", "DTYPE=RTOL,ATOL"),
        ("bfloat16=1e-2", "DTYPE=RTOL,ATOL"),
        ("bf16=1e-2,1e-5", "names dtype 'bf16'"),
        ("float32=x,1", "must be numbers"),
        ("float32=-1,1", ">= 0"),
        ("float32=nan,1", "finite"),
    ],
)
def test_bad_tol_option_is_one_config_error_naming_it(text, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        parse_tol_option(text)
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("float32: [1, 2, 3]\n", "must be {rtol: R, atol: A}"),
        ("float3: {rtol: 1}\n", "names dtype 'float3'"),
        ("[1, 2]\n", "must map dtype names"),
        ("float32: {rtol: 1\n", "not valid YAML"),
        ("float32: {rtol: -1}\n", ">= 0"),
    ],
)
def test_bad_tolerance_file_is_one_config_error(tmp_path, content, fragment):
    path = tmp_path / "tol.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        Tolerances.build(tol_file=str(path))
    assert fragment in str(info.value) and str(path) in str(info.value)


def test_missing_tolerance_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Tolerances.build(tol_file=str(tmp_path / "none.yaml"))
