"""Hostile and careless input, sixth round (issue #69), the minor items: a full disk during a checkpoint says the disk
is full, a datasets cache that cannot be written is named as the cache (not the data file), --eval-num-generations above
the bound of --num-eval warns as it does, and integers beyond 64 bits in a data file arrive as `datasets` makes them
(floats, the whole column). The code sandbox's own round is tests/test_isolation.py; the report reader's is
tests/test_benchmarks.py; tools/copy_tiers.py's flags are tests/test_copy.py's."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from test_bad_input import _gsm8k, _one_line, _run

from rlvr_utils.core import checkpoints
from rlvr_utils.extras.data import datafiles
from rlvr_utils.extras.save import saving


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full (a device whose every write is ENOSPC)")
def test_a_full_disk_during_a_checkpoint_says_the_disk_is_full(tmp_path):
    """trainer.pt written onto a full disk (/dev/full: every write fails with ENOSPC): the error is the OSError it is,
    so the run's one line says "the disk is full" (torch's own writer raised `unexpected pos`, which says nothing)."""
    (tmp_path / "trainer.pt").symlink_to("/dev/full")
    state = {"step": 3, "optimizer": {"exp_avg": torch.randn(1 << 16)}}
    with pytest.raises(OSError) as e:
        saving.write_state(None, tmp_path, 3, state, [None])
    assert e.value.errno == errno.ENOSPC
    assert checkpoints.io_cause(e.value).startswith("the disk is full"), checkpoints.io_cause(e.value)
    assert not (tmp_path / checkpoints.COMPLETE).exists()  # the copy is never marked whole


def test_a_datasets_cache_that_cannot_be_written_is_named_as_the_cache(tmp_path):
    """HF_DATASETS_CACHE under a file (as one that is read-only or full would fail): one line naming the cache and how
    to move it; the data file, which is fine, is not blamed."""
    data = _gsm8k(tmp_path / "g.jsonl", 30)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    out = _run("grpo.py", "--task", "gsm8k", "--data-path", str(data), env={"HF_DATASETS_CACHE": str(blocker / "c")})
    line = _one_line(out, f"the datasets cache {blocker / 'c'} cannot be written", "HF_DATASETS_CACHE")
    assert "--data-path" not in line and str(data) not in line, line


def test_the_cache_is_told_from_a_bad_file_by_the_error():
    """A full or read-only disk anywhere under load_dataset is the cache's (a data file is only read); an error naming
    a file inside the cache is the cache's; anything else stays the data file's."""
    from datasets import config

    inside = os.path.join(config.HF_DATASETS_CACHE, "json", "x.arrow")
    assert "the datasets cache" in datafiles._cache_problem(OSError(errno.ENOSPC, "No space left on device"))
    assert "the datasets cache" in datafiles._cache_problem(OSError(errno.EROFS, "Read-only file system", inside))
    assert "the datasets cache" in datafiles._cache_problem(PermissionError(errno.EACCES, "Permission denied", inside))
    assert datafiles._cache_problem(ValueError("Couldn't cast array of type string to int64")) is None
    assert datafiles._cache_problem(PermissionError(errno.EACCES, "Permission denied", "/data/rows.jsonl")) is None


def test_eval_num_generations_above_the_bound_warns_as_num_eval_does():
    out = _run("grpo_lambda.py", "--eval-num-generations", "64", "--lam", "2")
    _one_line(out, "--lam")
    assert "warning: --eval-num-generations 64: every evaluation generates 64 x --num-eval 200 = 12800" in out.stderr
    quiet = _run("grpo_lambda.py", "--eval-num-generations", "8", "--lam", "2")  # 1600: under the bound
    assert "warning: --eval-num-generations" not in quiet.stderr


def test_integers_beyond_64_bits_arrive_as_datasets_makes_them(tmp_path):
    """As a TRL user's load_dataset gives them (docs/tasks.md): a JSON column holding an integer beyond int64 is read
    as floats, the other rows' integers too; a CSV column holding one cannot be typed: one line naming the file."""
    rows = [{"prompt": "p", "big": 2**70, "small": 3}, {"prompt": "q", "big": 1, "small": 4}]
    rows += [{"prompt": "r", "big": -(2**63) - 1, "small": 5}]
    f = tmp_path / "big.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got, _ = datafiles.read_rows(f)
    assert [r["big"] for r in got] == [float(2**70), 1.0, float(-(2**63) - 1)]
    assert all(type(r["big"]) is float for r in got) and [type(r["small"]) for r in got] == [int] * 3
    edge = tmp_path / "edge.jsonl"  # int64's own range stays integers
    edge.write_text(json.dumps({"prompt": "p", "big": 2**63 - 1}) + "\n" + json.dumps({"prompt": "q", "big": -(2**63)}))
    assert [(r["big"], type(r["big"])) for r in datafiles.read_rows(edge)[0]] == [(2**63 - 1, int), (-(2**63), int)]
    csv = tmp_path / "big.csv"
    csv.write_text(f"prompt,big\np,{2**70}\nq,1\n")
    with pytest.raises(datafiles.DataFileError, match=r"big\.csv: cannot be read as csv by datasets"):
        datafiles.read_rows(csv)
