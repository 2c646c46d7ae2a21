"""`prune` (in memory, and loaded by path, killed and resumed) and perplexity on a CUDA device,
emulated on the CPU (tests/fake_cuda.py): every tensor the run puts on the GPU must meet only tensors
on the GPU, as a real one demands, and since the emulated device computes with the CPU's kernels, the
checkpoint must be the CPU run's, bit for bit."""
from __future__ import annotations

import pytest
import torch
from conftest import make_tokenizer, random_text, tiny_model
from fake_cuda import DeviceMixError, OnCuda, fake_cuda

import shuffleprune

DOCS = [random_text(300, seed=i) for i in range(30)]


@pytest.fixture
def one_thread():
    """SparseGPT factors on one CPU thread on the CPU only (runtime.determinism.one_cpu_thread): both runs on one
    thread, so the emulated GPU's factorizations sum in the CPU run's order."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _pruned(arch: str, recipe: str, device: str) -> tuple[dict[str, torch.Tensor], dict]:
    model = tiny_model(arch, layers=2)
    result = shuffleprune.prune(model, tokenizer=make_tokenizer(), calib=DOCS, eval_text=DOCS[:3], recipe=recipe,
                                device=device, nsamples=4, seqlen=32, progress=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, result.report


def _same_checkpoint(arch: str, recipe: str) -> None:
    want, _ = _pruned(arch, recipe, "cpu")
    with fake_cuda():
        got, report = _pruned(arch, recipe, "cuda")
    assert report["device"].startswith("cuda") and report["nm_ok"]
    assert not any(isinstance(v, OnCuda) for v in got.values())   # the model comes back on the CPU
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]


def test_the_emulated_gpu_refuses_what_a_gpu_refuses():
    with fake_cuda():
        assert torch.cuda.is_available()
        x = torch.ones(3, 4).to("cuda")
        assert x.device.type == "cuda" and (x * 2).device.type == "cuda"
        with pytest.raises(DeviceMixError):
            x + torch.ones(3, 4)
        with pytest.raises(DeviceMixError):
            x @ torch.ones(4, 2)
        assert torch.equal((x + torch.tensor(1.0)).cpu(), torch.full((3, 4), 2.0))   # a CPU scalar is allowed
        assert torch.equal(x[:, torch.tensor([0, 2])].cpu(), torch.ones(3, 2))       # so are CPU indices
        layer = torch.nn.Linear(4, 2)
        weight = layer.weight
        layer.to("cuda")
        assert layer.weight is weight and layer.weight.device.type == "cuda"
        with pytest.raises(DeviceMixError):
            layer(torch.ones(1, 4))
        assert type(layer.to("cpu").weight) is torch.nn.Parameter
        with torch.device("meta"):   # transformers asks this way whether it builds a model on the meta device
            assert torch.tensor([]).device.type == "meta"
        with pytest.raises(DeviceMixError):   # a CPU generator for a GPU draw
            torch.rand(3, generator=torch.Generator(), device="cuda")
        w = torch.nn.Parameter(torch.arange(4.0).to("cuda"))
        (w[torch.tensor([0, 0, 3, 3, 3])] * torch.arange(5.0).to("cuda")).sum().backward()   # repeats sum
        assert w.grad.device.type == "cuda" and torch.equal(w.grad.cpu(), torch.tensor([1.0, 0.0, 0.0, 9.0]))
        z = torch.polar(torch.ones(3), torch.tensor([0.5, 1.0, 2.0]))
        assert torch.equal((z.to("cuda") * z.to("cuda").conj()).cpu(), z * z.conj())   # a conjugate view
        w = torch.nn.Parameter(torch.zeros(2, 3).to("cuda"))
        (w.t() * torch.arange(6.0).view(3, 2).to("cuda")).sum().backward()   # a gradient laid out as w
        assert w.grad.device.type == "cuda" and torch.equal(w.grad.cpu(), torch.arange(6.0).view(3, 2).t())
    assert not torch.cuda.is_available() or torch.version.cuda


@pytest.mark.parametrize("recipe", ["fast", "balanced", "accurate", "paper", "best", "learned"])
def test_every_recipe_prunes_on_a_gpu_to_the_cpus_checkpoint(recipe, one_thread):
    # `learned` (--recon model) took its frozen weights before moving the model to the device, and
    # mixed CPU weights with GPU permutations at its first step
    _same_checkpoint("llama", recipe)


@pytest.mark.parametrize("arch", ["mixtral", "llama4_text", "dbrx", "gemma3n_text", "gpt2", "zamba2"])
def test_every_kind_of_model_prunes_on_a_gpu_to_the_cpus_checkpoint(arch, one_thread):
    # fused experts, experts stacked for one bmm and in 2-D slices, AltUp with shared keys and values,
    # Conv1D, a hybrid with a tied block
    _same_checkpoint(arch, "accurate")


@pytest.mark.parametrize("arch, recipe", [("mixtral", "learned"), ("llama4_text", "best")])
def test_moe_models_learn_their_permutations_on_a_gpu_to_the_cpus_checkpoint(arch, recipe, one_thread):
    # gradients through routed tokens (an index repeated per token and expert) and through Llama 4's
    # complex RoPE: the emulation got neither right before (repeats did not sum, x.conj() was read as
    # x), so these runs differed from the CPU's and were taken for a CUDA-only experts path
    _same_checkpoint(arch, recipe)


@pytest.mark.parametrize("blockwise", [False, True])
def test_perplexity_on_a_gpu_is_the_cpus(blockwise):
    # block by block (a model larger than the GPU), the blocks were run where they were, on the CPU
    from shuffleprune.evaluation.perplexity import perplexity

    model = tiny_model("llama", layers=2)
    tokens = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    want = perplexity(model, tokens, 64, "cpu")
    with fake_cuda():
        got = perplexity(model if blockwise else model.to("cuda"), tokens, 64, "cuda", blockwise=blockwise)
        model.to("cpu")
    assert got == want


class Crash(Exception):
    pass


@pytest.mark.parametrize("arch, recipe", [("llama", "accurate"), ("llama", "learned"), ("gemma3n_text", "accurate")])
def test_a_run_killed_and_resumed_on_a_gpu_gives_the_cpus_checkpoint(arch, recipe, text_file, eval_file, tmp_path,
                                                                    one_thread):
    # a checkpoint loaded by path on the GPU (transformers builds it on the meta device, then fills RoPE's
    # buffers), killed after a block and resumed there. Gemma 3n's blocks hand keys and values on, so its
    # resume replays the finished blocks on the GPU (they ran on the CPU before 8747549)
    from safetensors.torch import load_file

    from shuffleprune.prune.config import PruneConfig
    from shuffleprune.prune.driver import prune

    src = tmp_path / arch
    tiny_model(arch, layers=3).save_pretrained(src)
    make_tokenizer().save_pretrained(src)
    crash_at = 1 if arch == "gemma3n_text" else 0   # Gemma 3n: after the block that stores keys and values

    def cfg(device: str) -> PruneConfig:
        return PruneConfig.build(recipe, model=str(src), calib=str(text_file), eval_text=str(eval_file),
                                 nsamples=4, seqlen=32, eval_ctx=32, device=device)

    def crash(i: int) -> None:
        if i == crash_at:
            raise Crash

    full, part = tmp_path / "cpu", tmp_path / "gpu"
    want = prune(cfg("cpu"), out=full, progress=False).report
    with fake_cuda():
        with pytest.raises(Crash):
            prune(cfg("cuda"), out=part, progress=False, on_block_done=crash)
        got = prune(cfg("cuda"), out=part, resume=True, progress=False).report
    assert got["device"].startswith("cuda") and got["nm_ok"]
    a, b = load_file(str(full / "model.safetensors")), load_file(str(part / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert got["ppl"] == want["ppl"]


@pytest.fixture
def fresh_accelerate():
    """accelerate keeps its device in a process-wide state: made anew inside the emulation, and after."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _dst_config(tiny_dir, text_file):
    from shuffleprune.dst.config import TrainConfig

    return TrainConfig(arch="gpt2", config_kw={"n_layer": 2, "n_embd": 64, "n_head": 4}, tokenizer=str(tiny_dir),
                       data=str(text_file), seq_len=32, batch_size=4, steps=8, warmup=2, eval_every=4,
                       eval_tokens=2048, checkpoint_every=3)


def _dst_on_cpu_then_gpu(tiny_dir, text_file, tmp_path, dcfg, kill_at: int | None = None) -> tuple:
    """The same dst run on the CPU, then on the emulated GPU (there killed after step ``kill_at`` and
    resumed, if given): both reports and both saved models."""
    from accelerate.state import AcceleratorState
    from safetensors.torch import load_file

    from shuffleprune.dst.train import train

    cfg = _dst_config(tiny_dir, text_file)
    torch.manual_seed(0)
    want = train(cfg, dcfg, tmp_path / "cpu", progress=False)
    AcceleratorState._reset_state(True)   # accelerate picks its device anew, inside the emulation
    torch.manual_seed(0)
    with fake_cuda():
        if kill_at is not None:
            assert train(cfg, dcfg, tmp_path / "gpu", progress=False, stop_after=kill_at) == {"stopped_at": kill_at}
        got = train(cfg, dcfg, tmp_path / "gpu", resume=kill_at is not None, progress=False)
    return want, got, *(load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("cpu", "gpu"))


@pytest.mark.parametrize("method", ["nm", "srigl", "dsb", "pixelfly", "diag"])
def test_dst_with_learned_permutations_trains_on_a_gpu_the_cpus_model(method, tiny_dir, text_file, tmp_path,
                                                                      fresh_accelerate):
    # GPT-2's Conv1D weights reach their layers transposed, the soft permutations train beside them on
    # the device (they stayed on the CPU: a copy each way per layer and step, and Adam and the
    # projection on the host); diag and pixelfly add parameters of their own
    from shuffleprune.dst import DSTConfig

    dcfg = DSTConfig(method=method, sparsity=0.5 if method == "nm" else 0.75, block=16, delta_t=2, t_end=6,
                     perm="learned", t_perm=5, lambda_max=1e-2)
    want, got, a, b = _dst_on_cpu_then_gpu(tiny_dir, text_file, tmp_path, dcfg)
    assert got["device"].startswith("cuda") and want["device"] == "cpu"
    assert got["final_ppl"] == want["final_ppl"] and got["loss_curve"] == want["loss_curve"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dst_killed_and_resumed_on_a_gpu_gives_the_cpus_model(tiny_dir, text_file, tmp_path, fresh_accelerate):
    from shuffleprune.dst import DSTConfig

    dcfg = DSTConfig(method="dsb", block=16, sparsity=0.75, delta_t=2, t_end=6, perm="learned", t_perm=5,
                     lambda_max=1e-2, distribution="uniform")
    want, got, a, b = _dst_on_cpu_then_gpu(tiny_dir, text_file, tmp_path, dcfg, kill_at=4)
    assert got["final_ppl"] == want["final_ppl"] and got["loss_curve"] == want["loss_curve"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_sparsifier_keeps_its_soft_permutations_on_the_models_device():
    from shuffleprune.dst import DSTConfig, DynamicSparsifier

    model = tiny_model("gpt2", layers=2)
    with fake_cuda():
        model.to("cuda")
        sp = DynamicSparsifier(DSTConfig(method="srigl", sparsity=0.75, perm="learned", delta_t=2, t_end=6, t_perm=5))
        sp.prepare(model)
        assert sp.perms and all(isinstance(b, OnCuda) for p in sp.perms.values() for b in p.soft.blocks)
        model.to("cpu")


def test_eval_on_a_gpu_scores_what_the_cpu_scores(tiny_dir, tiny_task, tmp_path):
    # perplexity and an lm-eval task through HFLM on the model moved to the device
    from conftest import random_text

    heldout = tmp_path / "heldout.txt"
    heldout.write_text(random_text(2000, seed=3))
    common = dict(tasks=["tiny_mc", "ppl"], include_path=[str(tiny_task)], ppl_text=str(heldout), ppl_ctx=32,
                  batch_size=4, progress=False)
    want = shuffleprune.evaluate([str(tiny_dir)], device="cpu", **common)["models"][0]
    seen = []
    with fake_cuda():
        from torch.nn.modules.module import register_module_forward_hook

        hook = register_module_forward_hook(
            lambda module, args, out: seen.append(isinstance(out, OnCuda)) if isinstance(out, torch.Tensor) else None)
        try:
            got = shuffleprune.evaluate([str(tiny_dir)], device="cuda", **common)["models"][0]
        finally:
            hook.remove()
    assert seen and all(seen)   # every module's tensor output was on the device
    assert "--device cuda" in got["lm_eval_cli"]
    assert got["ppl"] == want["ppl"] and got["results"] == want["results"]


def test_a_whole_model_stage_the_gpu_cannot_hold_is_refused_before_any_data(tiny_dir, text_file, eval_file, tmp_path):
    # --recon model (recipe learned) holds the model, float32 copies and scores of its weights and
    # their effective weights on the device at once (a 7B model: at least 72.9 GiB before activations);
    # a GPU too small would run out of memory only after loading and calibrating. Refused up front,
    # by one line naming the ways out
    from shuffleprune.blocks import find_blocks, model_linears
    from shuffleprune.errors import UserError
    from shuffleprune.models import load_model
    from shuffleprune.perm.pruning import recon_learning_bytes
    from shuffleprune.prune.config import PruneConfig
    from shuffleprune.prune.driver import _check_device_memory, prune

    def cfg(recipe: str) -> PruneConfig:
        return PruneConfig.build(recipe, model=str(tiny_dir), calib=str(text_file), eval_text=str(eval_file),
                                 nsamples=4, seqlen=32, eval_ctx=32, device="cuda")

    model = load_model(str(tiny_dir)).model
    weights = model_linears(find_blocks(model))
    need = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) \
        + recon_learning_bytes(weights)   # the model, moved whole, and what learning holds beside it
    stages = cfg("learned").spec().stages
    out = tmp_path / "out"
    with fake_cuda():
        torch.cuda.mem_get_info = lambda *a, **k: (need + 2**30, 80 * 2**30)   # restored by fake_cuda
        _check_device_memory(stages, model, weights, torch.device("cuda"))     # just fits: 1 GiB to spare
        torch.cuda.mem_get_info = lambda *a, **k: (need + 2**30 - 1, 80 * 2**30)
        with pytest.raises(UserError, match=r"holds the whole model on cuda and at least .* more.*--recon block.*--device cpu"):
            _check_device_memory(stages, model, weights, torch.device("cuda"))
        with pytest.raises(UserError, match="GiB are free there"):
            prune(cfg("learned"), out=out, progress=False)
        assert not out.exists()   # nothing read, nothing written
        _check_device_memory(cfg("accurate").spec().stages, model, weights, torch.device("cuda"))   # block by block
