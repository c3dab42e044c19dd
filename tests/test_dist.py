"""Several processes under torchrun (gloo on CPU, 2 ranks): DDP and FSDP2 step exactly like one process with
the whole batch, ranks stay identical, only rank 0 writes, and bad setups fail fast with a clear message."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # every test here starts torchrun jobs (gloo on CPU): the suite's slowest file

ROOT = Path(__file__).resolve().parent.parent
DRIVER = str(ROOT / "tests" / "dist_driver.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # what the torchrun command runs, without relying on PATH
FIXED = [
    "--total-steps",
    "1",
    "--prompts-per-step",
    "4",
    "--num-generations",
    "4",
    "--micro-batch-size",
    "3",
    "--eval-every",
    "0",
    "--num-eval",
    "4",
    "--loss-agg",
    "token-mean",
]


def launch(
    out: Path, *args: str, nproc: int = 2, env: dict | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    cmd = ([*TORCHRUN, "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]) + [
        DRIVER,
        str(out),
        *args,
    ]
    e = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **(env or {}))  # gloo on CPU, even on a GPU host
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=e)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    r = launch(out, "--fixed", "grpo.py", *FIXED, "--output-dir", str(out / "runs"), nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out / "world1_rank0.pt")


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """The bundled model with its own lm_head (a copy of the embedding, perturbed), saved: FSDP shards it apart."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import common

    path = tmp_path_factory.mktemp("untied")
    m = AutoModelForCausalLM.from_pretrained(common.DEFAULT_MODEL)
    m.config.tie_word_embeddings = False
    w = m.model.embed_tokens.weight.detach().clone()
    m.lm_head.weight = torch.nn.Parameter(w + 0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    m.save_pretrained(path)
    AutoTokenizer.from_pretrained(common.DEFAULT_MODEL).save_pretrained(path)
    out = tmp_path_factory.mktemp("untied_one")
    r = launch(out, "--fixed", "grpo.py", *FIXED, "--model", str(path), "--output-dir", str(out / "runs"), nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    return path, torch.load(out / "world1_rank0.pt")


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "fsdp-untied"])
def test_two_ranks_with_half_the_batch_step_like_one_with_all(one_process, tmp_path, mode, request):
    flags = ["--fsdp"] if mode.startswith("fsdp") else []
    model, one = request.getfixturevalue("untied") if mode == "fsdp-untied" else (None, one_process)
    flags += ["--model", str(model)] if model else []
    r = launch(tmp_path, "--fixed", "grpo.py", *FIXED, *flags, "--output-dir", str(tmp_path / "runs"), "--save-model")
    assert r.returncode == 0, r.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "world2_rank0.pt"), torch.load(tmp_path / "world2_rank1.pt")
    assert max_diff(r0["params"], r1["params"]) == 0.0  # the ranks hold the same model
    assert one["fused"] and r0["fused"]  # fused lm_head log-probs (no [b, T, V] logits), under FSDP too
    assert max_diff(one["grads"], r0["grads"]) < 1e-6  # the gradient the optimizer saw (~0.05 at most)
    assert max_diff(one["params"], r0["params"]) < 1e-5
    from transformers import AutoModelForCausalLM

    import common

    start = AutoModelForCausalLM.from_pretrained(model or common.DEFAULT_MODEL).state_dict()
    assert max_diff(start, r0["params"]) > 5e-5  # it did train (one AdamW step moves weights by about lr = 1e-4)
    (run,) = (tmp_path / "runs").iterdir()  # only rank 0 wrote a run directory, with the metrics and the model
    saved = AutoModelForCausalLM.from_pretrained(run / "model").state_dict()
    assert max_diff(saved, r0["params"]) == 0.0


@pytest.fixture(scope="module")
def one_process_bf16(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_bf16")
    r = launch(out, "--fixed", "grpo.py", *FIXED, "--dtype", "bfloat16", "--output-dir", str(out / "runs"), nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out / "world1_rank0.pt")


def test_bf16_compute_trains_fp32_masters_on_two_ranks_and_its_checkpoints_move(one_process_bf16, tmp_path):
    """--dtype bfloat16 (mixed precision): under DDP the fp32 gradients of the masters are all-reduced (no DDP module:
    its buckets would be bf16), under FSDP the fp32 shards train under MixedPrecisionPolicy(bf16, fp32). Either way the
    optimizer sees fp32 weights and gradients, the ranks stay identical, the two agree, and they step like one process
    up to bf16's rounding of other row groupings (Adam's first step: at most a sign, 2 x lr, apart). The FSDP run's
    sharded fp32 checkpoint resumes in one process (into its masters), the DDP run's full one under FSDP."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import common

    start = AutoModelForCausalLM.from_pretrained(common.DEFAULT_MODEL).state_dict()
    got = {}
    for mode, flags in (("ddp", []), ("fsdp", ["--fsdp"])):
        out = tmp_path / mode
        r = launch(out, "--fixed", "grpo.py", *FIXED, "--dtype", "bfloat16", "--save-every", "1", *flags,
                   "--output-dir", str(out / "runs"))  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        r0, r1 = torch.load(out / "world2_rank0.pt"), torch.load(out / "world2_rank1.pt")
        assert {t.dtype for t in [*r0["params"].values(), *r0["grads"].values()]} == {torch.float32}
        assert max_diff(r0["params"], r1["params"]) == 0.0
        assert max_diff(one_process_bf16["grads"], r0["grads"]) < 2e-3  # |gradient| up to ~0.05
        assert max_diff(one_process_bf16["params"], r0["params"]) <= 2.01e-4  # lr 1e-4
        assert max_diff(start, r0["params"]) > 5e-5
        got[mode] = r0
    assert max_diff(got["ddp"]["params"], got["fsdp"]["params"]) < 1e-6
    ddp_run, fsdp_run = run_dir(tmp_path / "ddp" / "runs"), run_dir(tmp_path / "fsdp" / "runs")
    assert {t.dtype for t in load_file(str(ddp_run / "checkpoint" / "model" / "model.safetensors")).values()} == {
        torch.float32
    }
    for run, nproc, flags in ((fsdp_run, 1, []), (ddp_run, 2, ["--fsdp"])):
        r = launch(tmp_path / f"resumed{nproc}", "grpo.py", "--resume", str(run), "--total-steps", "2", *flags,
                   nproc=nproc)  # fmt: skip
        assert r.returncode == 0 and "note:" not in r.stderr, r.stderr[-3000:]
        assert steps_logged(run) == [0, 1, 2]


def test_an_fsdp_checkpoint_of_bf16_shards_resumes_into_fp32_ones_with_one_line(tmp_path):
    """Shards written before fp32 masters (bf16 weights and AdamW state: here --pure-bf16 plain's, its config.json
    without the flag, as such a run's is) resume under FSDP's mixed precision, upcast, with one line (rank 0's)."""
    flags = ["--fsdp", "--dtype", "bfloat16", "--pure-bf16", "plain", "--save-every", "1"]
    r = launch(tmp_path / "a", "grpo.py", *SMALL, "--total-steps", "1", *flags, "--output-dir", str(tmp_path / "runs"))
    assert r.returncode == 0, r.stderr[-3000:]
    run = run_dir(tmp_path / "runs")
    config = json.loads((run / "config.json").read_text())
    del config["pure_bf16"], config["save_dtype"]
    (run / "config.json").write_text(json.dumps(config))
    r = launch(tmp_path / "b", "grpo.py", "--resume", str(run), "--total-steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    notes = [line for line in r.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1 and notes[0].count("note:") == 1 and "upcast to the float32 masters" in notes[0], notes
    assert {t.dtype for t in torch.load(tmp_path / "b" / "world2_rank0.pt")["params"].values()} == {torch.float32}
    assert steps_logged(run) == [0, 1, 2]


def test_global_token_normalization_is_what_makes_them_equal(one_process, tmp_path):
    """The same comparison fails when each rank normalizes by its own token count (the assertion above can fail)."""
    r = launch(
        tmp_path, "--fixed", "grpo.py", *FIXED, "--output-dir", str(tmp_path / "runs"), env={"DRIVER_LOCAL_COUNTS": "1"}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert max_diff(one_process["grads"], torch.load(tmp_path / "world2_rank0.pt")["grads"]) > 1e-5


@pytest.mark.parametrize("script, extra", [("grpo.py", []), ("srpo.py", ["--reset", "self"])])
def test_scripts_train_two_steps_under_torchrun(tmp_path, script, extra):
    r = launch(
        tmp_path,
        script,
        "--total-steps",
        "2",
        "--prompts-per-step",
        "4",
        "--eval-every",
        "0",
        "--num-eval",
        "8",
        "--output-dir",
        str(tmp_path / "runs"),
        *extra,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "world2_rank0.pt"), torch.load(tmp_path / "world2_rank1.pt")
    assert max_diff(r0["params"], r1["params"]) == 0.0
    (run,) = (tmp_path / "runs").iterdir()
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3  # steps 0, 1, 2, written once (by rank 0)


def test_bad_setups_fail_fast_with_a_clear_message(tmp_path):
    r = launch(tmp_path, "grpo.py", "--total-steps", "1", "--prompts-per-step", "3", "--output-dir", str(tmp_path))
    assert r.returncode != 0 and "must be divisible by the world size 2" in r.stderr
    r = launch(
        tmp_path,
        "grpo.py",
        "--total-steps",
        "1",
        "--prompts-per-step",
        "4",
        "--output-dir",
        str(tmp_path),
        env={"DRIVER_BAD_FLAGS": "1"},
    )
    assert r.returncode != 0 and "different flags" in r.stderr and "learning_rate" in r.stderr
    t0 = time.time()  # a rank that dies: the other one does not wait for it
    r = launch(
        tmp_path,
        "grpo.py",
        "--total-steps",
        "5",
        "--prompts-per-step",
        "4",
        "--output-dir",
        str(tmp_path),
        "--dist-timeout",
        "60",
        env={"DRIVER_DIE_AT_STEP": "1"},
    )
    assert r.returncode != 0 and time.time() - t0 < 60


# --- FSDP for every script, sharded checkpoints, world-size changes, preemption, rank failure, two nodes (#38) ---
SMALL = ["--prompts-per-step", "4", "--num-generations", "4", "--micro-batch-size", "3", "--eval-every", "0"]
SMALL += ["--num-eval", "4"]
SCRIPTS = [
    ("grpo.py", []),
    ("sc_grpo.py", ["--micro-batch-size", "4"]),  # one group per micro-batch: ranks differ in teacher passes
    ("grpo_lambda.py", []),  # its traced loss inside grpo.py's micro-batch loop
    ("ep_grpo.py", []),
    ("srpo.py", ["--reset", "self"]),  # ranks differ in sampling and localization rounds
]


def run_dir(runs: Path) -> Path:
    (d,) = runs.iterdir()
    return d


def steps_logged(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("script, extra", SCRIPTS)
def test_fsdp_steps_as_ddp_and_its_sharded_checkpoint_resumes_on_two_ranks_then_one(tmp_path, script, extra):
    """DDP for 3 steps; FSDP for 2 with a sharded checkpoint each step, resumed for the 3rd on 2 ranks: the same
    gradient at step 1 and the same weights after step 3 (bit for bit on CPU: no step lost or repeated, every random
    stream restored); then a 4th step in one process from the same sharded checkpoint."""
    ddp = launch(tmp_path / "ddp", script, *SMALL, "--total-steps", "3", "--output-dir", str(tmp_path / "d"), *extra)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    flags = ["--fsdp", "--save-every", "1", "--output-dir", str(tmp_path / "f")]
    fsdp = launch(tmp_path / "fsdp", script, *SMALL, "--total-steps", "2", *flags, *extra)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    run = run_dir(tmp_path / "f")
    assert (run / "checkpoint" / "sharded" / ".metadata").is_file() and not (run / "checkpoint" / "model").exists()
    resumed = launch(tmp_path / "res2", script, "--resume", str(run), "--total-steps", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = torch.load(tmp_path / "ddp" / "world2_rank0.pt"), torch.load(tmp_path / "fsdp" / "world2_rank0.pt")
    assert max_diff(a["grads"], b["grads"]) < 1e-6
    assert max_diff(a["params"], torch.load(tmp_path / "res2" / "world2_rank0.pt")["params"]) < 1e-6
    if script == "sc_grpo.py":  # the padding was needed: a rank ran a teacher forward for another's sake
        assert b["idle"]["teacher"] + torch.load(tmp_path / "fsdp" / "world2_rank1.pt")["idle"]["teacher"] > 0
    one = launch(tmp_path / "res1", script, "--resume", str(run), "--total-steps", "4", nproc=1)
    assert one.returncode == 0, one.stderr[-3000:]
    assert steps_logged(run) == [0, 1, 2, 3, 4]


def test_a_one_process_checkpoint_resumes_under_fsdp_as_under_ddp(tmp_path):
    """A full (one-process) checkpoint: its weights and index-keyed AdamW state are sharded on load under FSDP; the
    step after it is the one DDP takes from the same checkpoint."""
    r = launch(tmp_path / "one", "grpo.py", *SMALL, "--total-steps", "1", "--save-every", "1", "--output-dir",
               str(tmp_path / "runs"), nproc=1)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = run_dir(tmp_path / "runs")
    other = tmp_path / "copy" / run.name
    shutil.copytree(run, other)
    for mode, where, flags in (("ddp", run, []), ("fsdp", other, ["--fsdp"])):
        r = launch(tmp_path / mode, "grpo.py", "--resume", str(where), "--total-steps", "2", *flags)
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = torch.load(tmp_path / "ddp" / "world2_rank0.pt"), torch.load(tmp_path / "fsdp" / "world2_rank0.pt")
    assert max_diff(a["params"], b["params"]) < 1e-6  # (their first recorded grads differ: DCP's optimizer set-up
    # runs one zero-gradient step under FSDP before the state is loaded)


def _popen(out: Path, *args: str, agent: list[str] | None = None) -> subprocess.Popen:
    cmd = (agent or [*TORCHRUN, "--standalone", "--nproc_per_node", "2"]) + [DRIVER, str(out), *args]
    e = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.2)


def _checkpoint_step(run: Path) -> int:
    try:
        return json.loads((run / "checkpoint" / "complete.json").read_text())["step"]
    except (OSError, ValueError):
        return 0


@pytest.mark.parametrize("fsdp", [False, True])
def test_sigterm_to_the_agent_saves_one_checkpoint_that_resumes_with_no_step_lost(tmp_path, fsdp):
    """What a preempting scheduler does: SIGTERM to torchrun, which forwards it to every rank; the ranks agree to stop
    after the step in progress, save, and exit; --resume continues from the next step."""
    flags = ["--total-steps", "200", "--output-dir", str(tmp_path / "runs"), *(["--fsdp"] if fsdp else [])]
    p = _popen(tmp_path / "a", "grpo.py", *SMALL, *flags)
    _wait_for(lambda: (tmp_path / "runs").exists() and any((tmp_path / "runs").iterdir()), p)
    run = run_dir(tmp_path / "runs")
    _wait_for(lambda: (run / "metrics.jsonl").exists() and len(steps_logged(run)) >= 2, p)  # step 1 done
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0 and "SIGTERM: the run stops after this step" in err, err[-3000:]
    step = _checkpoint_step(run)
    assert step >= 1 and steps_logged(run) == list(range(step + 1)), err[-3000:]
    r = launch(tmp_path / "b", "grpo.py", "--resume", str(run), "--total-steps", str(step + 1))
    assert r.returncode == 0, r.stderr[-3000:]
    assert steps_logged(run) == list(range(step + 2))


def test_a_killed_worker_stops_the_job_and_the_last_checkpoint_resumes(tmp_path):
    """kill -9 of one rank mid-run: torchrun stops the other, the checkpoint of an earlier step stays whole, and
    --resume goes on from it (the metrics past it are dropped, so no step is repeated)."""
    flags = ["--total-steps", "200", "--save-every", "1", "--output-dir", str(tmp_path / "runs"), "--fsdp"]
    p = _popen(tmp_path / "a", "grpo.py", *SMALL, *flags)
    _wait_for(lambda: (tmp_path / "runs").exists() and any((tmp_path / "runs").iterdir()), p)
    run = run_dir(tmp_path / "runs")
    _wait_for(lambda: _checkpoint_step(run) >= 2, p)
    workers = [
        int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    ]
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGKILL)
    p.communicate(timeout=120)
    assert p.returncode != 0
    step = _checkpoint_step(run)
    assert step >= 2
    r = launch(tmp_path / "b", "grpo.py", "--resume", str(run), "--total-steps", str(step + 1))
    assert r.returncode == 0, r.stderr[-3000:]
    assert steps_logged(run) == list(range(step + 2))


def test_two_nodes_on_this_machine(tmp_path):
    """Two torchrun agents, one process each, meeting through a c10d rendezvous on 127.0.0.1: the multi-node launch
    of docs/scaling.md, for two steps."""
    port = _free_port()
    agents = []
    for node in (0, 1):
        agent = [
            *TORCHRUN,
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(node),
            "--rdzv_backend",
            "c10d",
        ]
        agent += ["--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "rlvr-test"]
        out = ["--total-steps", "2", "--output-dir", str(tmp_path / "runs")]  # the nodes share a file system
        agents.append(_popen(tmp_path / f"n{node}", "grpo.py", *SMALL, *out, agent=agent))
    errs = [a.communicate(timeout=300)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    assert steps_logged(run_dir(tmp_path / "runs")) == [0, 1, 2]  # one run directory, written by rank 0
    r0, r1 = torch.load(tmp_path / "n0" / "world2_rank0.pt"), torch.load(tmp_path / "n1" / "world2_rank1.pt")
    assert max_diff(r0["params"], r1["params"]) == 0.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_with_fewer_micro_batches_run_idle_passes_under_fsdp(tmp_path):
    """Rank 0 has two micro-batches, rank 1 one: under FSDP rank 1 runs one idle pass (otherwise the collectives of
    rank 0's second forward have no partner and the job hangs until --dist-timeout); the gradient is DDP's."""
    for mode in ("ddp", "fsdp"):
        cmd = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", str(ROOT / "tests" / "dist_uneven.py")]
        e = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        r = subprocess.run([*cmd, str(tmp_path), mode], cwd=ROOT, capture_output=True, text=True, timeout=300, env=e)
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "fsdp.pt")
    assert a["n"] == b["n"] == 2  # rank 0's count (DDP: its own; FSDP: the most over ranks)
    assert max_diff(a["grads"], b["grads"]) < 1e-6
    assert max(g.abs().max().item() for g in a["grads"].values()) > 1e-3  # a real gradient


def _advantages_by_group(res: dict) -> dict:
    """group id -> the group's per-token advantages [G, T'] (its rows in order, trimmed to its completion lengths)."""
    rows = res["rows"]
    out = {}
    for g in rows["gid"].unique().tolist():
        idx = (rows["gid"] == g).nonzero().flatten()
        width = int(rows["mask"][idx].sum(1).max())
        out[g] = rows["adv"][idx, :width] * rows["mask"][idx, :width]
    return out


@pytest.mark.parametrize(
    "script, extra",
    [
        ("ep_grpo.py", []),
        ("ep_grpo.py", ["--gate", "zsig"]),
        ("sc_grpo.py", ["--kl-threshold-scope", "batch"]),
        ("grpo.py", ["--scale-rewards", "batch"]),
    ],
)
def test_batch_statistics_are_over_the_global_batch(tmp_path, script, extra):
    """A statistic the method takes over "the batch" (EP-GRPO's entropy quantile tau and zsig's z-score, SC-GRPO's c
    with --kl-threshold-scope batch, --scale-rewards batch's std) is the global batch's on every rank: the same global
    batch on 1 and on 2 ranks gives every row the same per-token advantages and the optimizer the same gradient."""
    flags = ["--fixed", script, *FIXED, "--prompts-per-step", "6", "--micro-batch-size", "4", *extra]
    env = {"DRIVER_FIRST_CHOICE": "1"}  # SC-GRPO's random routing made the same on 1 and 2 ranks
    one = launch(tmp_path / "one", *flags, "--output-dir", str(tmp_path / "one" / "runs"), nproc=1, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    two = launch(tmp_path / "two", *flags, "--output-dir", str(tmp_path / "two" / "runs"), env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    single = torch.load(tmp_path / "one" / "world1_rank0.pt")
    ranks = [torch.load(tmp_path / "two" / f"world2_rank{r}.pt") for r in (0, 1)]
    want = _advantages_by_group(single)
    got = {**_advantages_by_group(ranks[0]), **_advantages_by_group(ranks[1])}
    assert got.keys() == want.keys() and len(want) == 6
    assert max((got[g] - want[g]).abs().max().item() for g in want) < 1e-5
    assert max(w.abs().max().item() for w in want.values()) > 0.1  # the advantages are not all 0
    assert max_diff(single["grads"], ranks[0]["grads"]) < 1e-5
