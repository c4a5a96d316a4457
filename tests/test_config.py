import json
import os
import subprocess
import sys

import pytest

from probe.config import KEYS, Config, from_dict, from_env, load
from probe.errors import ConfigError, ProbeError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (file name, file text, fragments the one-sentence message must contain)
BAD_CONFIGS = [
    ("unknown_key.json", '{"dump_pth": "./d"}',
     ["unknown_key.json", "unknown key 'dump_pth'", "did you mean 'dump_path'?"]),
    ("unknown_key_far.json", '{"zzz": 1}',
     ["unknown_key_far.json", "unknown key 'zzz'", "valid keys are task, dump_path"]),
    ("seed_bool.json", '{"seed": true}',
     ["seed_bool.json", "seed is true (bool)", "an int in 0 .. 4294967295"]),
    ("seed_negative.json", '{"seed": -1}', ["seed is -1", "0 .. 4294967295"]),
    ("seed_too_big.yaml", "seed: 4294967296\n", ["seed_too_big.yaml", "seed is 4294967296"]),
    ("seed_float.json", '{"seed": 1.5}', ["seed is 1.5 (float)"]),
    ("task_typo.json", '{"task": "statistic"}',
     ['task is "statistic"', '"statistics" | "tensor" | "checksum"', "did you mean 'statistics'?"]),
    ("level_bad.yaml", "level: modules\n",
     ['level is "modules"', '"module" | "api" | "mix"', "did you mean 'module'?"]),
    ("step_item.json", '{"step": [0, 1, "x"]}',
     ["step_item.json", 'step[2] is "x"', 'range string like "0-3"']),
    ("step_bool.json", '{"step": [0, true]}', ["step[1] is true (bool)"]),
    ("step_reversed.json", '{"step": ["5-2"]}', ['step[0] is "5-2"', "a <= b", '"2-5"']),
    ("rank_negative.json", '{"rank": [-1]}', ["rank[0] is -1", "0 .. 2147483647"]),
    ("rank_huge_range.json", '{"rank": ["0-99999999"]}', ["rank[0]", "at most 1000000"]),
    ("mode_quoted.json", '{"mode": "true"}',
     ['mode is "true"', 'false, true or "warn"', "write true without quotes"]),
    ("mode_typo.yaml", "mode: warm\n", ['mode is "warm"', "did you mean 'warn'?"]),
    ("mode_int.json", '{"mode": 1}', ["mode is 1 (int)", 'false, true or "warn"']),
    ("remove_dropout.json", '{"remove_dropout": "yes"}', ['remove_dropout is "yes"', "true or false"]),
    ("scope_int.json", '{"scope": ["blocks.0", 3]}', ["scope[1] is 3 (int)", "module-path prefixes"]),
    ("scope_empty.json", '{"scope": [""]}', ['scope[0] is ""', "use [] to select all"]),
    ("list_regex.json", '{"list": ["functional.linear", "re:(matmul"]}',
     ['list[1] is "re:(matmul"', "valid regular expression", "missing )"]),
    ("data_mode_typo.json", '{"data_mode": ["forward", "ouput"]}',
     ['data_mode[1] is "ouput"', '"all" | "forward"', "did you mean 'output'?"]),
    ("data_mode_empty.json", '{"data_mode": []}', ["data_mode is []", '["all"]']),
    ("buffer_zero.json", '{"buffer_mb": 0}', ["buffer_mb is 0", "1 .. 1048576"]),
    ("dump_path_empty.json", '{"dump_path": ""}', ['dump_path is ""', "non-empty path"]),
    ("dump_path_null.yaml", "dump_path:\n", ["dump_path is null"]),
    ("broken.json", '{\n  "seed": 1,\n  "task": "tensor",,\n}',
     ["broken.json", "invalid JSON", "line 3, column 20"]),
    ("broken.yaml", "seed: 1\nstep: [0, 1\ntask: tensor\n",
     ["broken.yaml", "invalid YAML", "line 3, column"]),
    ("tabs.yaml", "seed: 1\n\ttask: tensor\n", ["tabs.yaml", "invalid YAML", "line 2, column 1"]),
    ("duplicate.json", '{"seed": 1, "seed": 2}', ["duplicate.json", "'seed' appears twice"]),
    ("duplicate.yml", "seed: 1\nseed: 2\n", ["duplicate.yml", "'seed' appears twice", "line 2, column 1"]),
    ("nan.json", '{"seed": NaN}', ["nan.json", "NaN is not valid JSON"]),
    ("empty.json", "  \n", ["empty.json", "the file is empty"]),
    ("empty.yaml", "", ["empty.yaml", "the file is empty"]),
    ("comment_only.yaml", "# nothing here\n", ["comment_only.yaml", "holds no config (null)"]),
    ("top_list.json", "[1, 2]", ["top_list.json", "the top level is list", "expected a mapping"]),
    ("top_string.yaml", "just text\n", ["top_string.yaml", "the top level is string"]),
    ("config.toml", 'seed = 1\n', ["config.toml", "unsupported file extension '.toml'", ".json, .yaml, .yml"]),
    ("noext", '{"seed": 1}', ["noext", "unsupported file extension '(none)'"]),
    ("latin1.json", b'{"dump_path": "caf\xe9"}', ["latin1.json", "not UTF-8"]),
]


@pytest.mark.parametrize("name,text,fragments", BAD_CONFIGS, ids=[case[0] for case in BAD_CONFIGS])
def test_bad_config_raises_one_sentence_naming_file_key_value_and_what_is_allowed(
        tmp_path, name, text, fragments):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as caught:
        load(path)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message
    assert message.startswith(str(path))


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.json: no such config file"):
        load(tmp_path / "missing.json")


def test_directory_is_a_config_error(tmp_path):
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(ConfigError, match=r"folder\.json: is a directory"):
        load(tmp_path / "folder.json")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_is_a_config_error(tmp_path):
    path = tmp_path / "secret.json"
    path.write_text("{}")
    path.chmod(0)
    with pytest.raises(ConfigError, match="permission denied"):
        load(path)


def test_config_error_is_a_probe_error():
    assert issubclass(ConfigError, ProbeError)


# ---------------------------------------------------------------- good configs


def test_json_and_yaml_load_to_the_same_normalised_config(tmp_path):
    data = {"task": "tensor", "level": "mix", "step": [3, "0-2", 3, "7"], "rank": "1-2",
            "seed": 42, "mode": "warn", "scope": "blocks.0", "list": ["re:.*matmul.*"],
            "data_mode": "forward", "buffer_mb": 64, "remove_dropout": True}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text(
        "task: tensor\nlevel: mix\nstep: [3, 0-2, 3, '7']\nrank: 1-2\nseed: 42\nmode: warn\n"
        "scope: blocks.0\nlist: ['re:.*matmul.*']\ndata_mode: forward\nbuffer_mb: 64\n"
        "remove_dropout: true\n")
    from_json, from_yaml = load(tmp_path / "c.json"), load(tmp_path / "c.yaml")
    assert from_json == from_yaml
    assert from_json.step == (0, 1, 2, 3, 7)
    assert from_json.rank == (1, 2)
    assert from_json.scope == ("blocks.0",)
    assert from_json.data_mode == ("forward",)
    assert from_json.source == str(tmp_path / "c.json")


def test_empty_mapping_gives_the_documented_defaults(tmp_path):
    (tmp_path / "c.json").write_text("{}")
    config = load(tmp_path / "c.json")
    assert config == Config()
    assert {name: spec.default for name, spec in KEYS.items()} == Config().to_dict()


def test_to_dict_is_json_and_round_trips_through_from_dict():
    config = from_dict({"step": ["2-4"], "mode": True, "list": ["functional.linear"]})
    data = json.loads(json.dumps(config.to_dict()))
    assert data["step"] == [2, 3, 4]
    assert "source" not in data
    assert from_dict(data) == config


def test_repo_example_config_json_loads():
    config = load(os.path.join(REPO_ROOT, "config.json"))
    assert (config.task, config.level, config.step, config.seed, config.mode) == (
        "statistics", "mix", (0,), 1234, True)


def test_config_is_frozen_and_replace_revalidates():
    config = Config()
    with pytest.raises(AttributeError):
        config.seed = 3
    assert config.replace(seed=3).seed == 3
    with pytest.raises(ConfigError, match="seed is -3"):
        config.replace(seed=-3)
    with pytest.raises(ConfigError, match="did you mean 'level'"):
        config.replace(levl="api")


def test_constructing_config_directly_validates_too():
    with pytest.raises(ConfigError, match=r"<defaults>: step\[0\] is -1"):
        Config(step=[-1])
    assert Config(step=[2, 1]).step == (1, 2)


def test_from_dict_rejects_non_mappings_and_names_the_source():
    with pytest.raises(ConfigError, match="^here: the top level is list"):
        from_dict([("seed", 1)], source="here")


# ---------------------------------------------------------------- selection helpers


def test_scope_matches_prefixes_on_dot_boundaries():
    config = Config(scope=("blocks.0",))
    assert config.in_scope("blocks.0") and config.in_scope("blocks.0.attn.qkv")
    assert not config.in_scope("blocks.01") and not config.in_scope("blocks.1")
    assert Config().in_scope("anything")


def test_list_matches_exact_op_names_key_substrings_and_re_prefixed_regexes():
    config = Config(list=("functional.linear", "blocks.1/", "re:^torch\\.(bmm|matmul)$"))
    assert config.matches_list("functional.linear", "fc/functional.linear#0/forward/output.0")
    assert not config.matches_list("functional.linear_extra", "fc/x#0/forward/output.0")
    assert config.matches_list("Tensor.add", "blocks.1/Tensor.add#0/forward/input.0")
    assert config.matches_list("torch.matmul") and config.matches_list("torch.bmm")
    assert not config.matches_list("torch.matmul_out")
    assert Config().matches_list("anything")


@pytest.mark.parametrize("data_mode,allowed", [
    (("all",), {("forward", "in"), ("forward", "out"), ("backward", "in"), ("backward", "out")}),
    (("forward",), {("forward", "in"), ("forward", "out")}),
    (("input",), {("forward", "in"), ("backward", "in")}),
    (("backward", "output"), {("backward", "out")}),
])
def test_data_mode_selects_phases_and_directions(data_mode, allowed):
    config = Config(data_mode=data_mode)
    every = {(p, io) for p in ("forward", "backward") for io in ("in", "out")}
    assert {pair for pair in every if config.wants_data(*pair)} == allowed


def test_step_and_rank_selection_empty_means_all():
    assert Config().wants_step(10**6) and Config().wants_rank(7)
    config = Config(step=("1-2",), rank=(0,))
    assert config.wants_step(2) and not config.wants_step(3)
    assert config.wants_rank(0) and not config.wants_rank(1)


# ---------------------------------------------------------------- environment hand-off


def test_from_env_reads_probe_config_and_probe_seed_overrides_its_seed(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"seed": 5, "level": "mix"}')
    assert from_env({}) is None
    assert from_env({"PROBE_CONFIG": str(path)}).seed == 5
    config = from_env({"PROBE_CONFIG": str(path), "PROBE_SEED": "9"})
    assert (config.seed, config.level) == (9, "mix")
    assert from_env({"PROBE_SEED": "9"}) == Config(seed=9)
    with pytest.raises(ConfigError, match=r"\$PROBE_SEED: seed is \"x\""):
        from_env({"PROBE_SEED": "x"})


def test_config_module_does_not_import_torch():
    code = "import sys, probe.config, probe.commands.run; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "False"
