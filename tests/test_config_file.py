"""--config FILE (rlvr_utils/extras/run_io/config_file.py): a YAML, TOML or JSON file whose keys are the flags' names,
the command line overriding it, parsed by tyro as the command line is; a run directory's config.json starts the same run
again (the same metrics, bit for bit on CPU); an unknown key, a value of the wrong type, a missing or unreadable file:
one line naming the file and the key, exit code 2, before anything loads."""

import json
import sys

import pytest
from helpers import read_metrics, run_dir, run_inprocess

import grpo
import sc_grpo
from rlvr_utils.core import cli, flag_groups
from rlvr_utils.extras.run_io import config_file

TINY = ["--eval-every", "1", "--num-eval", "4", "--prompts-per-step", "2", "--num-generations", "4"]
TINY += ["--max-new-tokens", "16", "--threads", "1"]


def _parse(monkeypatch, *argv, script=grpo, name="grpo.py"):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    validate = getattr(script, "validate", None)
    return cli.parse(script.Args, validate, {"sc_grpo.py": "sc_ablations"}.get(name))


def _refused(monkeypatch, capsys, *argv, **kw) -> str:
    with pytest.raises(SystemExit) as e:
        _parse(monkeypatch, *argv, **kw)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


FILES = {  # the same flags in each format: snake_case and kebab-case keys, YAML's 1e-4 (a string to PyYAML)
    "c.yaml": "learning_rate: 1e-4\ntotal-steps: 3\nloss_agg: token-mean\ndynamic_sampling: true\n"
    "epsilon_high: null\ntemperature: 0.7\nlora_rank: 2\nlora_target_modules: [q_proj, v_proj]\n",
    "c.toml": 'learning_rate = 1e-4\ntotal-steps = 3\nloss_agg = "token-mean"\ndynamic_sampling = true\n'
    'temperature = 0.7\nlora_rank = 2\nlora_target_modules = ["q_proj", "v_proj"]\n',
    "c.json": '{"learning_rate": 1e-4, "total-steps": 3, "loss_agg": "token-mean", "dynamic_sampling": true, '
    '"epsilon_high": null, "temperature": 0.7, "lora_rank": 2, "lora_target_modules": ["q_proj", "v_proj"]}',
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_the_files_keys_are_the_flags_and_the_command_line_overrides_them(tmp_path, monkeypatch, name):
    path = tmp_path / name
    path.write_text(FILES[name])
    a = _parse(monkeypatch, "--config", str(path), "--output-dir", str(tmp_path))
    assert (a.learning_rate, a.total_steps, a.loss_agg, a.dynamic_sampling) == (1e-4, 3, "token-mean", True)
    assert (a.temperature, a.lora_rank, a.lora_target_modules) == (0.7, 2, ("q_proj", "v_proj"))
    assert a.epsilon_high == a.epsilon  # None, filled from --epsilon as on the command line
    b = _parse(monkeypatch, "--config", str(path), "--total-steps", "5", "--no-dynamic-sampling", "--lora-rank=4")
    assert (b.total_steps, b.dynamic_sampling, b.lora_rank, b.learning_rate) == (5, False, 4, 1e-4)
    c = _parse(monkeypatch, f"--config={path}", "--lora-target-modules", "o_proj")
    assert c.lora_target_modules == ("o_proj",) and c.temperature == 0.7


def test_a_repeated_flag_on_the_command_line_replaces_the_files_values():
    """--reward-fn appends each time it is given: the command line's replaces the file's rather than adding to it."""
    values = {"reward_fn": ["a.py:f", "b.py:g"], "seed": 3}
    words = config_file.words("c.yaml", values, grpo.Args, ["--reward-fn", "c.py:h"])
    assert words == {"seed": ["--seed=3"]}
    words = config_file.words("c.yaml", values, grpo.Args, [])
    assert words["reward_fn"] == ["--reward-fn", "a.py:f", "--reward-fn", "b.py:g"]
    parsed = flag_groups.parse(grpo.Args, [*words["reward_fn"], *words["seed"]])
    assert parsed.reward_fn == ("a.py:f", "b.py:g") and parsed.seed == 3
    both = flag_groups.parse(grpo.Args, ["--reward-fn", "c.py:h"])
    assert both.reward_fn == ("c.py:h",)


BAD = [  # (file name, text, words of the one line)
    ("typo.yaml", "lerning_rate: 0.1\n", ["typo.yaml: lerning_rate is not a flag of grpo.py", "learning_rate?"]),
    ("int.yaml", "seed: 1.5\n", ["int.yaml: seed:", "1.5"]),
    ("choice.toml", 'loss_agg = "sum"\n', ["choice.toml: loss_agg:", "'sum'", "token-mean"]),
    ("bool.yaml", "save_model: yes please\n", ["bool.yaml: save_model is 'yes please', not true or false"]),
    ("list.yaml", "seed: [1, 2]\n", ["list.yaml: seed is a list, not one value of --seed"]),
    ("map.json", '{"seed": {"a": 1}}', ["map.json: seed is a mapping"]),
    ("top.json", "[1, 2]", ["top.json: its top level must be a mapping"]),
    ("broken.yaml", "seed: [1\n", ["broken.yaml: not valid YAML"]),
    ("broken.toml", "seed = \n", ["broken.toml: not valid TOML"]),
    ("twice.yaml", "total_steps: 2\ntotal-steps: 3\n", ["twice.yaml: total-steps is given twice"]),
    ("resume.yaml", "resume: runs/x\n", ["resume.yaml: resume: a resumed run keeps the flags"]),
    ("other.json", '{"script": "sc_grpo.py", "alpha": 0.2}', ["other.json: its flags are sc_grpo.py's"]),
    ("conf.ini", "seed=1\n", ["conf.ini: a .yaml, .yml, .toml or .json file"]),
]


@pytest.mark.parametrize("name, text, words", BAD, ids=[b[0] for b in BAD])
def test_a_bad_file_or_key_is_one_line_naming_both(tmp_path, monkeypatch, capsys, name, text, words):
    (tmp_path / name).write_text(text)
    line = _refused(monkeypatch, capsys, "--config", str(tmp_path / name), "--output-dir", str(tmp_path / "r"))
    assert line.startswith(f"error: --config {tmp_path / name}"), line
    assert all(w in line for w in words), line
    assert not (tmp_path / "r").exists()  # before anything: no run directory


def test_a_missing_file_and_a_second_config_are_one_line(tmp_path, monkeypatch, capsys):
    line = _refused(monkeypatch, capsys, "--config", str(tmp_path / "no.yaml"))
    assert line == f"error: --config {tmp_path / 'no.yaml'}: no such file"
    (tmp_path / "a.yaml").write_text("seed: 2\n")
    line = _refused(monkeypatch, capsys, "--config", str(tmp_path / "a.yaml"), "--config", str(tmp_path / "a.yaml"))
    assert "--config is given more than once" in line
    line = _refused(monkeypatch, capsys, "--config", str(tmp_path / "a.yaml"), "--resume", str(tmp_path))
    assert "--config and --resume" in line


def test_an_ablation_key_brings_its_flags(tmp_path, monkeypatch):
    """A run started with an ablation flag has it in its config.json: the file asks for the ablation module."""
    (tmp_path / "c.json").write_text(json.dumps({"script": "sc_grpo.py", "divergence": "sampled-logratio"}))
    a = _parse(monkeypatch, "--config", str(tmp_path / "c.json"), script=sc_grpo, name="sc_grpo.py")
    assert a.divergence == "sampled-logratio" and a.ablation_module is not None


def test_a_run_directorys_config_json_starts_the_same_run_again(tmp_path):
    run_inprocess("grpo.py", "--total-steps", "2", "--output-dir", str(tmp_path / "a"), *TINY, "--top-k", "5")
    config = run_dir(tmp_path / "a") / "config.json"
    run_inprocess("grpo.py", "--config", str(config), "--output-dir", str(tmp_path / "b"))
    again = json.loads((run_dir(tmp_path / "b") / "config.json").read_text())
    first = json.loads(config.read_text())
    assert {k: v for k, v in again.items() if k != "output_dir"} == {
        k: v for k, v in first.items() if k != "output_dir"
    }
    timing = ("time/", "tokens_per_second", "memory/")
    same = lambda rows: [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rows]  # noqa: E731
    assert same(read_metrics(tmp_path / "b")) == same(read_metrics(tmp_path / "a"))
