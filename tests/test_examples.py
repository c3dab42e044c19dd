"""The worked examples in the credit functions' docstrings (the `>>>` lines a reader checks a copy against) run as
doctests: each function has one, and its printed numbers are what the function returns."""

import doctest

import pytest

import common
import ep_grpo
import grpo_lambda
import sc_grpo
import srpo

EXAMPLES = [
    (common, "group_advantages"),
    (sc_grpo, "weights_and_advantages"),
    (grpo_lambda, "grpo_lambda_token_loss"),
    (ep_grpo, "ep_advantages"),
    (srpo, "srpo_advantages"),
    (srpo, "suffix_mask"),
]


@pytest.mark.parametrize("module,name", EXAMPLES, ids=[f"{m.__name__}.{n}" for m, n in EXAMPLES])
def test_the_docstring_example_runs_and_prints_what_it_says(module, name):
    tests = doctest.DocTestFinder(recurse=False).find(getattr(module, name), name, globs=vars(module))
    examples = [ex for test in tests for ex in test.examples]
    assert len(examples) >= 3, f"{module.__name__}.{name}: its docstring has {len(examples)} examples, not 3 or more"
    runner = doctest.DocTestRunner()
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted == len(examples) and result.failed == 0, f"{module.__name__}.{name}: {result}"
