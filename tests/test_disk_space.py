"""Disk space: prune refuses an --out whose disk cannot hold its result (before clearing it) and warns
when the run's checkpoints may not fit; a write that runs out of space in prune, export or dst is a
one-line error (it was a traceback from torch or safetensors) that leaves no half-written output.
Memory: calibration activations larger than the memory free are refused before any text is read, and an
allocation that fails in prune or dst is a one-line error."""
import errno
import json
import re

import pytest
import torch
from conftest import flat_config

import shuffleprune.outdir as outdir
from shuffleprune.errors import UserError


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_prune_checks_the_space_of_out_before_clearing_it(tiny_dir, text_file, tmp_path, monkeypatch):
    from shuffleprune.prune import prune

    config = flat_config(model=str(tiny_dir), calib=str(text_file), nsamples=4, seqlen=32, eval_text=None)
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.txt").write_text("kept")
    monkeypatch.setattr(outdir, "free_bytes", lambda d: 1000)   # and the 4 bytes --overwrite frees
    with pytest.raises(UserError, match=rf"--out '{out}': 1004 B free on its disk, and what the run writes there takes "
                                        r"about \d+ KiB; free space or give another --out"):
        prune(config, out=out, overwrite=True, progress=False)
    assert (out / "earlier.txt").read_text() == "kept"
    result = prune(config, progress=False)   # the same run without --out: nothing is written, nothing checked
    size = sum(p.numel() for p in result.model.parameters()) * 4   # the checkpoint in float32
    monkeypatch.setattr(outdir, "free_bytes", lambda d: size + 1000 - outdir.tree_bytes(out))   # room for it alone
    with pytest.warns(UserWarning, match=r"and the run may write up to about .* there \(its checkpoints along the way, "
                                         r"then its result\): it may run out of space"):
        report = prune(config, out=out, overwrite=True, progress=False).report
    assert report["nm_ok"] and not (out / "earlier.txt").exists()   # cleared: its bytes were counted as freed



def test_prune_refuses_calibration_activations_larger_than_the_free_memory(tiny_dir, text_file, tmp_path, monkeypatch):
    """--nsamples 1000000 on a small model filled 24 GiB and was killed; now a one-line error, before any text
    is read, names the windows, the bytes (3× one block's inputs: its inputs, outputs and one more while the
    capture joins its batches; 5× with the dense model's stream) and the fix, and --out is left as it was."""
    import shuffleprune.prune.driver as driver
    import shuffleprune.prune.run_texts as run_texts
    import shuffleprune.runtime.memory as memory
    from shuffleprune.prune import PruneConfig

    one = 8 * 32 * 64 * 4   # 8 windows of 32 tokens, hidden 64, float32
    config = flat_config(model=str(tiny_dir), calib=str(text_file), nsamples=8, seqlen=32, eval_text=None)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 3 * one - 1)   # more than inputs and outputs
    read = []
    real = run_texts.calibration_windows
    monkeypatch.setattr(run_texts, "calibration_windows", lambda *a, **k: read.append(1) or real(*a, **k))
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"^--nsamples 8 windows of 32 tokens need about 192 KiB for the blocks' inputs "
                                        r"and outputs on cpu, and 192 KiB are free there; lower --nsamples or --seqlen$"):
        driver.prune(config, out=out, progress=False)
    assert not read and not out.exists()
    best = PruneConfig.build("best", model=str(tiny_dir), calib=str(text_file), nsamples=8, seqlen=32, eval_text=None)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 5 * one - 1)
    with pytest.raises(UserError, match=r"need about 320 KiB for the blocks' inputs and outputs for the pruned and the "
                                        r"dense model on cpu"):
        driver.prune(best, progress=False)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 3 * one)
    assert driver.prune(config, progress=False).report["nm_ok"] and read

def test_a_full_disk_mid_run_is_one_line_and_the_run_resumes(tiny_dir, text_file, tmp_path, monkeypatch):
    import shuffleprune.prune.driver as driver
    import shuffleprune.prune.run_dir as run_dir

    config = flat_config(model=str(tiny_dir), calib=str(text_file), nsamples=4, seqlen=32, eval_text=None)
    out, real = tmp_path / "out", run_dir.save_file
    calls = []

    def fills_at_block_1(*args, **kwargs):
        calls.append(args[1])
        return _no_space() if len(calls) == 2 else real(*args, **kwargs)

    monkeypatch.setattr(run_dir, "save_file", fills_at_block_1)
    with pytest.raises(UserError, match=rf"^ran out of disk space writing in '{out}' \(\[Errno 28\] No space left on device\): "
                                        r"free space or give another --out; then the same command with --resume continues it$"):
        driver.prune(config, out=out, progress=False)
    assert calls[-1].endswith("block_1.safetensors")
    monkeypatch.setattr(run_dir, "save_file", real)
    assert driver.prune(config, out=out, resume=True, progress=False).report["nm_ok"]
    assert not (out / ".resume").exists()

    def short_write(*args, **kwargs):   # torch's serializer on a full disk: no errno, a position mismatch
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1920 vs 1872")

    monkeypatch.setattr(run_dir, "atomic_save", short_write)
    monkeypatch.setattr(outdir, "free_bytes", lambda d: 2**30)   # the disk has room: some other fault, shown as it is
    with pytest.raises(RuntimeError, match="unexpected pos"):
        driver.prune(config, out=tmp_path / "other", progress=False)
    monkeypatch.setattr(outdir, "free_bytes", lambda d: 2**20)   # the checks pass …
    monkeypatch.setattr(driver, "check_free_space", lambda *a, **k: None)
    with pytest.raises(UserError, match=r"ran out of disk space writing in .* \(\[enforce fail .* unexpected pos 1920 vs 1872\)"):
        driver.prune(config, out=tmp_path / "other", progress=False)   # … and the write fails with 1 MiB left
    assert not (tmp_path / "other").exists()   # nothing to resume: the run's dir is gone again


def test_export_and_dst_name_a_full_disk_and_leave_no_partial_output(tiny_dir, text_file, tmp_path, monkeypatch):
    import shuffleprune.deploy.export as export
    from shuffleprune.dst import DSTConfig
    from shuffleprune.dst.config import TrainConfig
    from shuffleprune.dst.train import CHECKPOINT, REPORT, train
    from shuffleprune.prune import prune

    prune(flat_config(model=str(tiny_dir), calib=str(text_file), nsamples=4, seqlen=32, eval_text=None),
          out=tmp_path / "pruned", progress=False)
    monkeypatch.setattr(export, "save_file", _no_space)
    with pytest.raises(UserError, match=rf"^ran out of disk space writing in '{tmp_path / 'deployed'}' .*: free space or "
                                        r"give another export target$"):
        export.export_checkpoint(tmp_path / "pruned", tmp_path / "deployed", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "pruned", "tiny-llama"]   # no temporary sibling

    cfg = TrainConfig(arch="gpt2", config_kw={"n_layer": 1, "n_embd": 32, "n_head": 2}, tokenizer=str(tiny_dir),
                      data=str(text_file), seq_len=32, batch_size=2, steps=4, warmup=1, eval_every=0, eval_tokens=1024,
                      checkpoint_every=3)
    real_save, saves = torch.save, []

    def save_then_fill(obj, path, *args, **kwargs):   # the disk fills after the first checkpoint
        saves.append(path)
        return real_save(obj, path, *args, **kwargs) if len(saves) == 1 else _no_space()

    monkeypatch.setattr(torch, "save", save_then_fill)
    run = tmp_path / "dst"
    with pytest.raises(UserError, match=rf"^ran out of disk space writing in '{run}' .*; then the same command with "
                                        r"--resume continues it$"):
        train(cfg, DSTConfig(method="nm", pattern="2:4"), run, progress=False)
    assert sorted(p.name for p in run.iterdir()) == [CHECKPOINT, "dst_report.json", "model"]   # none half-written
    assert json.loads((run / REPORT).read_text())["final_ppl"] > 0 and (run / "model" / "config.json").is_file()


def test_eval_checks_the_space_for_its_results_and_a_full_disk_leaves_no_temporary_file(tiny_dir, eval_file, tmp_path,
                                                                                         monkeypatch):
    from pathlib import Path

    import shuffleprune

    out = tmp_path / "results.json"
    monkeypatch.setattr(outdir, "free_bytes", lambda d: 0)
    with pytest.raises(UserError, match=rf"^--out '{out}': 0 B free on its disk, and what the run writes there takes "
                                        r"about 8\.0 MiB; free space or give another --out$"):
        shuffleprune.evaluate(str(tiny_dir), tasks="ppl", ppl_text=str(eval_file), out=out)
    monkeypatch.undo()
    real = Path.write_text
    monkeypatch.setattr(Path, "write_text", lambda self, *a, **k: _no_space() if self.name.endswith(".md.tmp")
                        else real(self, *a, **k))   # the disk fills after the .json
    with pytest.raises(UserError, match=rf"^ran out of disk space writing in '{out}' \(\[Errno 28\] No space left on device\)"):
        shuffleprune.evaluate(str(tiny_dir), tasks="ppl", ppl_text=str(eval_file), out=out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heldout.txt", "results.json", "tiny-llama"]


def test_a_second_run_on_the_same_out_is_refused_while_the_first_goes_on(tiny_dir, text_file, tmp_path):
    """Two runs writing one --out at once (a job started twice) interleaved their checkpoints; the
    second is now refused and touches nothing of the first's, which is then free to go on."""
    from shuffleprune.dst import DSTConfig
    from shuffleprune.dst.config import TrainConfig
    from shuffleprune.dst.train import train
    from shuffleprune.prune import prune

    config = flat_config(model=str(tiny_dir), calib=str(text_file), nsamples=4, seqlen=32, eval_text=None)
    out = tmp_path / "out"
    with outdir.held_alone(out):   # the first run, between its start and its first checkpoint
        (out / ".resume").mkdir()
        (out / ".resume" / "data.pt").write_bytes(b"the first run's")
        for second in (lambda: prune(config, out=out, overwrite=True, progress=False),
                       lambda: train(TrainConfig(arch="gpt2", tokenizer=str(tiny_dir), data=str(text_file)),
                                     DSTConfig(method="nm", pattern="2:4"), out, overwrite=True, progress=False)):
            with pytest.raises(UserError, match=rf"^another run is writing in --out '{out}'; wait for it to end, or give "
                                                r"another --out$"):
                second()
            assert (out / ".resume" / "data.pt").read_bytes() == b"the first run's"
    assert prune(config, out=out, overwrite=True, progress=False).report["nm_ok"]   # released: a run goes on
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    with outdir.held_alone(out):   # the same directory through a link is the same hold
        with pytest.raises(UserError, match="another run is writing in --out"):
            prune(config, out=link, overwrite=True, progress=False)


@pytest.mark.parametrize("fault", [RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                                                "allocate memory: you tried to allocate 9830400000 bytes"),
                                   torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("std::bad_alloc"),   # torch's C++ code under a memory limit (ulimit -v)
                                   MemoryError()])
def test_an_allocation_that_fails_in_prune_or_dst_is_one_line(tiny_dir, text_file, tmp_path, monkeypatch, fault):
    """``dst --batch-size 100000`` ended in torch's allocator traceback; now a one-line error names the options
    to lower, and neither run leaves an output behind. Other errors pass through as they are."""
    import shuffleprune.dst.train as dst_train
    import shuffleprune.prune.driver as driver
    from shuffleprune.dst import DSTConfig
    from shuffleprune.dst.config import TrainConfig

    def short(*args, **kwargs):
        raise fault

    cause = re.escape(str(fault)[:140] or type(fault).__name__)   # what the allocation said, quoted as it is
    monkeypatch.setattr(driver, "capture_block_inputs", short)
    config = flat_config(model=str(tiny_dir), calib=str(text_file), nsamples=4, seqlen=32, eval_text=None)
    with pytest.raises(UserError, match=rf"^ran out of memory \({cause}\): lower --batch-size, --nsamples or --seqlen$"):
        driver.prune(config, out=tmp_path / "pruned", progress=False)
    assert not (tmp_path / "pruned").exists()
    monkeypatch.setattr(dst_train, "build_model", short)
    cfg = TrainConfig(arch="llama", tokenizer=str(tiny_dir), data=str(text_file), seq_len=32, steps=2)
    with pytest.raises(UserError, match=rf"^ran out of memory \({cause}\): lower --batch-size or --seq-len, or train a "
                                        r"smaller model$"):
        dst_train.train(cfg, DSTConfig(method="rigl"), tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst").exists()
    monkeypatch.setattr(driver, "capture_block_inputs", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="^a bug$"):
        driver.prune(config, progress=False)
