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
    """SparseGPT factors on one CPU thread on the CPU only (runtime.one_cpu_thread): both runs on one
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
