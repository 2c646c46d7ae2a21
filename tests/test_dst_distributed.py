"""`shuffleprune dst` on several processes: the global batch is split across them, DDP averages the
model's gradients, the sparsifier averages the soft permutations' own, and every process ends with
the same weights, masks and permutations. Run here as 2 CPU processes (gloo), as on GPUs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from shuffleprune.dst.config import TrainConfig
from shuffleprune.dst.train import _batch

# a permutation hardened from the uniform start is decided by tiny differences of M: if the
# processes took different permutation steps, they would end with different permutations
ARGS = ["--arch", "gpt2", "--config-kw", "n_layer=2,n_embd=64,n_head=4,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
        "--seq-len", "32", "--steps", "12", "--warmup", "2", "--eval-every", "0", "--eval-tokens", "1024",
        "--checkpoint-every", "0", "--method", "dsb", "--block", "16", "--sparsity", "0.75", "--delta-t", "3",
        "--perm", "learned", "--perm-lr", "0.01", "--perm-start", "0", "--lambda-max", "1e-2", "--t-perm", "8",
        "--distribution", "uniform", "--quiet"]


def _run(processes: int, args: list[str], command: str = "dst") -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # `python -m shuffleprune`, as the README launches a multi-GPU run (torchrun / accelerate launch -m)
    return subprocess.run([*(launcher if processes > 1 else [sys.executable]), "-m", "shuffleprune", command, *args],
                          capture_output=True, text=True, env=env, timeout=300)


def _rank_errors(stderr: str) -> str:
    """A failed launch's stderr for the assertion message: the ranks' own tracebacks and abort lines (the
    launcher's summary at the end names only signals), then its last 1000 characters."""
    lines = stderr.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("Traceback") or "terminate called" in line
                  or "Error" in line), len(lines))
    return "\n".join(lines[first:first + 40]) + "\n…\n" + stderr[-1000:]


def test_each_process_trains_on_its_share_of_the_global_batch():
    stream = torch.arange(10_000)
    cfg = TrainConfig(seq_len=16, batch_size=6, seed=3)
    whole = _batch(stream, cfg, step=7)
    shares = [_batch(stream, cfg, step=7, rank=r, world=3) for r in range(3)]
    assert all(len(s) == 2 for s in shares)
    assert torch.equal(torch.stack([shares[r][i] for i in range(2) for r in range(3)]), whole)
    assert not torch.equal(_batch(stream, cfg, step=8), whole)


def test_two_processes_follow_the_single_process_run_and_agree(tiny_dir, text_file, tmp_path):
    common = ARGS + ["--tokenizer", str(tiny_dir), "--data", str(text_file), "--batch-size", "4"]
    one, two = _run(1, common + ["--out", str(tmp_path / "one")]), _run(2, common + ["--out", str(tmp_path / "two")])
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, _rank_errors(two.stderr)
    assert two.stdout.count("final ppl") == 1  # printed by the main process only
    a = json.loads((tmp_path / "one" / "dst_report.json").read_text())
    b = json.loads((tmp_path / "two" / "dst_report.json").read_text())
    assert (a["processes"], a["ranks_agree"]) == (1, None)
    assert (b["processes"], b["ranks_agree"]) == (2, True)
    # the first steps see identical weights: the averaged half-batch losses are the global batch's
    la, lb = [r["loss"] for r in a["loss_curve"]], [r["loss"] for r in b["loss_curve"]]
    assert la[:2] == lb[:2]
    assert max(abs(x - y) for x, y in zip(la, lb)) < 0.05  # later steps drift by float summation order only
    assert abs(b["final_ppl"] / a["final_ppl"] - 1) < 0.02
    assert all(p["hardened_at"] is not None for p in b["permutations"].values())
    assert all(l["whole_blocks"] and l["pruned_weights_zero"] for l in b["layers"].values())
    from safetensors.torch import load_file

    maps = load_file(str(tmp_path / "two" / "model" / "index_maps.safetensors"))
    assert maps and all(torch.equal(torch.sort(p.long()).values, torch.arange(p.numel())) for p in maps.values())


def test_finetune_on_two_processes_follows_the_single_process_run(tiny_dir, text_file, tmp_path):
    """``finetune`` is the same trainer: each process starts from the pruned checkpoint, trains on its share of the
    global batch, and they end agreeing, with the zeros held."""
    from safetensors.torch import load_file

    from shuffleprune.prune import PruneConfig, prune

    pruned = tmp_path / "pruned"
    prune(PruneConfig.build("fast", model=str(tiny_dir), calib=str(text_file), nsamples=4, seqlen=32, eval_text=None),
          out=pruned, progress=False)
    common = [str(pruned), "--data", str(text_file), "--seq-len", "32", "--steps", "6", "--warmup", "1", "--lr", "3e-3",
              "--batch-size", "4", "--eval-every", "0", "--eval-tokens", "512", "--checkpoint-every", "0", "--quiet"]
    one = _run(1, common + ["--out", str(tmp_path / "one")], "finetune")
    two = _run(2, common + ["--out", str(tmp_path / "two")], "finetune")
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, _rank_errors(two.stderr)
    assert two.stdout.count("wrote") == 1   # printed by the main process only
    a = json.loads((tmp_path / "one" / "dst_report.json").read_text())
    b = json.loads((tmp_path / "two" / "dst_report.json").read_text())
    assert (b["processes"], b["ranks_agree"]) == (2, True) and a["evals"][0] == b["evals"][0]   # the same start
    la, lb = [r["loss"] for r in a["loss_curve"]], [r["loss"] for r in b["loss_curve"]]
    assert la[0] == lb[0] and max(abs(x - y) for x, y in zip(la, lb)) < 0.05
    before, after = load_file(str(pruned / "model.safetensors")), load_file(str(tmp_path / "two" / "model" / "model.safetensors"))
    assert all(not after[k][before[k] == 0].any() for k in before if ".layers." in k and before[k].dim() == 2)


def test_a_global_batch_that_does_not_split_is_refused(tiny_dir, text_file, tmp_path):
    out = tmp_path / "bad"
    r = _run(2, ARGS + ["--tokenizer", str(tiny_dir), "--data", str(text_file), "--batch-size", "3", "--out", str(out)])
    assert r.returncode != 0 and "use a multiple of the 2 processes" in r.stdout + r.stderr
    assert not out.exists()


def test_a_run_ends_the_process_group_it_started_and_leaves_a_callers_alone(tmp_path):
    """A process whose gloo group is still alive at exit can abort in the interpreter's teardown (a known
    cause of the abort a CI run's rank 1 met once): a successful run destroys the group its Accelerator
    started; a group the caller made before is left, and so is one after a failure (its peers may still be
    inside a collective)."""
    import pytest
    import torch.distributed as dist

    from shuffleprune.dst.train import _process_group_ended

    def start(name: str) -> None:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / name), 1), rank=0, world_size=1)

    with _process_group_ended():
        start("run")
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="failed"), _process_group_ended():
        start("failed")
        raise RuntimeError("failed")
    assert dist.is_initialized()
    dist.destroy_process_group()
    start("caller")
    try:
        with _process_group_ended():
            pass
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_the_main_process_is_told_by_the_launchers_rank(monkeypatch):
    """The process that prints and writes is rank 0 as torchrun (RANK) or an MPI launcher (PMI_RANK,
    OMPI_COMM_WORLD_RANK) numbers it, read without a process group; alone, a process is the main one."""
    from shuffleprune.dst.train import is_main_process

    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert is_main_process()
    for name, rank, main in (("RANK", "1", False), ("RANK", "0", True), ("OMPI_COMM_WORLD_RANK", "3", True)):
        monkeypatch.setenv(name, rank)   # RANK, when set, comes first
        assert is_main_process() is main, (name, rank)
    monkeypatch.delenv("RANK")
    assert not is_main_process()   # OMPI_COMM_WORLD_RANK=3
