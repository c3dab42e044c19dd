"""A copier's check (docs/conventions.md, "Copy a method's credit into your own loop"): a method's credit function,
imported from the script's minimal copy outside the repository, trains 2 steps in a loop of the copier's own
(tests/copier_loop.py: plain transformers, its own sampling and rewards, not the project's loop) with the function's
own defaults, and loads nothing beyond the minimal copy. SC-GRPO's loop makes its own teacher prompts (build_teachers
takes a make_prompt callable and plain tensors): some group is partial-solve, f is in [0, 1) on the weighted tokens and
the weights are exactly 1 on plain rows."""

import json
import math
import shutil

import pytest
from conftest import ROOT
from test_copy import copy_minimal, copy_tiers, run


@pytest.mark.slow
@pytest.mark.parametrize("script", ["sc_grpo.py", "grpo_lambda.py", "ep_grpo.py"])
def test_a_copiers_own_loop_trains_with_the_methods_credit_function(script, tmp_path):
    here = copy_minimal(script, tmp_path / "myproj")
    shutil.copy(ROOT / "tests" / "copier_loop.py", here)
    out = run(["copier_loop.py", script.removesuffix(".py")], cwd=here)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stdout[-3000:]
    result = json.loads(line[len("RESULT ") :])
    assert len(result["losses"]) == 2 and all(math.isfinite(v) for v in result["losses"]), result
    assert result["change"] > 0, result  # the credit moved the weights
    assert result["module"] == str(here / script)  # the copy's, not the repository's
    assert set(result["loaded"]) <= {*copy_tiers.minimal(script), script, "copier_loop.py"}, result["loaded"]
    if script == "sc_grpo.py":  # the teacher ran: a partial-solve group, f from D in [0, 1), plain rows untouched
        sc = result["sc"]
        assert len(sc) == 2 and sum(s["partial"] for s in sc) >= 1, sc
        assert all(0 <= lo <= hi < 1 for lo, hi in (s["f"] for s in sc if s["f"] is not None)), sc
        assert any(s["f"] is not None and s["f"][1] > 0 for s in sc) and all(s["plain_weights_one"] for s in sc), sc
