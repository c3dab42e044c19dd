"""Hostile and careless input, fifth round (issue #62): a run directory from someone else never runs its code on
--resume (trainer.pt and a sharded checkpoint are read as tensors, numbers and lists), a reward cannot change what the
next call or the run sees (its rows, chat prompts, torch's global state, trainer_state.log_history), a reward's
failure is one line whatever its objects do, paths with `~user`, the credit page never writes over a run's files, a
LoRA rank beyond the layers, and the code sandbox's writes through sqlite3. Each is one line (exit code 2 for what the
user passed, 1 for what failed while running), no traceback, nothing run that the user did not ask for."""

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_bad_input import TINY, _one_line, _run

from rlvr_utils import checkpoints, resume


class _Planted:
    """What a hostile trainer.pt holds: unpickling it runs a shell command that touches `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# --- 1. --resume reads tensors, numbers and lists, never code ---------------------------------------------------------
@pytest.mark.slow
def test_resume_refuses_a_trainer_pt_that_would_run_code(saved, tmp_path):
    d = tmp_path / saved.name
    shutil.copytree(saved, d)
    marker = tmp_path / "ran"
    state = torch.load(d / "checkpoint" / "trainer.pt", weights_only=False)  # the test's own file
    torch.save({**state, "extra": {"x": _Planted(marker)}}, d / "checkpoint" / "trainer.pt")
    line = _one_line(_run("grpo.py", "--resume", str(d), "--total-steps", "2"), "trainer.pt is refused", "system")
    assert not marker.exists(), line


def test_trainer_pt_loads_weights_only_and_an_older_one_with_numpy_arrays_still_loads(tmp_path, capsys):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    before = np.random.get_state()
    state = {"step": 1, "batches_drawn": 0, "optimizer": opt.state_dict(), "numpy": checkpoints.numpy_state()}
    torch.save(state, tmp_path / "new.pt")
    new = torch.load(tmp_path / "new.pt", weights_only=True)  # the format itself: no safe globals needed
    np.random.set_state(new["numpy"])
    a = np.random.rand(3)
    torch.save({**state, "numpy": before}, tmp_path / "old.pt")  # as saved before issue #62: an array
    old = resume._load(tmp_path / "old.pt", tmp_path)
    np.random.set_state(old["numpy"])
    assert (a == np.random.rand(3)).all()
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(SystemExit) as e:
        resume._load(tmp_path / "list.pt", tmp_path)
    assert e.value.code == 2 and "list.pt is not a checkpoint" in capsys.readouterr().err


def _dcp_checkpoint(path: Path, optimizer_value=None):
    """A one-process DCP checkpoint of a small model and its AdamW state, as sharded.save writes under --fsdp."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    if optimizer_value is not None:
        osd = {**osd, "param_groups": [dict(g, lr=optimizer_value) for g in osd["param_groups"]]}
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(path))
    return model, opt


@pytest.mark.filterwarnings("ignore")  # DCP warns that no process group is initialized
def test_a_sharded_checkpoint_that_would_run_code_is_refused(tmp_path, capsys):
    from rlvr_utils import sharded

    marker = tmp_path / "ran"
    model, _ = _dcp_checkpoint(tmp_path / "good")
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    sharded.restore(tmp_path / "good", other, torch.optim.AdamW(other.parameters(), lr=1e-3), tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    _dcp_checkpoint(tmp_path / "value", optimizer_value=_Planted(marker))  # a planted non-tensor value
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))  # a planted index
    for bad, words in [("value", "value optimizer.param_groups"), ("index", ".metadata is refused")]:
        with pytest.raises(SystemExit) as e:
            sharded.restore(tmp_path / bad, other, torch.optim.AdamW(other.parameters()), tmp_path)
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and err.count("\n") == 1 and not marker.exists(), err
