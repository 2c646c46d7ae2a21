"""Shared fixtures: tiny random-weight decoder LMs (built from configs, no downloads) and a tokenizer."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU through the interpreter: set before anything
    os.environ.setdefault("TRITON_INTERPRET", "1")   # imports Triton (transformers 5.17 does, and Triton 3.6
    # then ran a kernel's helpers compiled, not interpreted: "Cannot call @triton.jit'd outside of ... a kernel")

# transformers >= 5.25 swaps the hub's kernels into every plain from_pretrained (the tests' own client loads), which
# fetches them and fails outright where the installed `kernels` is not the version it wants: off, as transformers'
# own tests turn it off, so the suite never reaches the hub (shuffleprune's own loads pass use_kernels=False)
os.environ.setdefault("USE_HUB_KERNELS", "NO")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":   # ... every access of theirs checked, their programs shuffled
    from interpret_checks import install as _install_kernel_checks, installed_interpreter_mismatch, \
        violations as _kernel_violations

    _MISMATCH = installed_interpreter_mismatch()   # pytest_configure stops the run with it
    KERNELS_CHECKED = not _MISMATCH and _install_kernel_checks()
else:
    KERNELS_CHECKED, _kernel_violations, _MISMATCH = False, [], None


def pytest_configure(config) -> None:
    if _MISMATCH:   # one line naming the fix, not 400 kernel tests failing on the interpreter itself
        pytest.exit(_MISMATCH, returncode=2)

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # pytest-xdist (the Makefile's test): the machine's cores shared out among its workers, the
    # command-line runs a test starts too, rather than each worker's threads contending for all of them
    _THREADS = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which "
         "but have an they you were her she there been one all we their has would when if so no will "
         "what up out more can about into than them only other time new some could these two may first "
         "then do any like my now over such our man me even most made after also did many before must").split()


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[EOS]": 1}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]", pad_token="[EOS]")


def tiny_config(model_type: str = "llama", layers: int = 3, hidden: int = 64, inter: int = 128, vocab: int = 128):
    from transformers import AutoConfig

    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if model_type in ("gemma2", "gemma3_text"):
        kw.update(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
    if model_type == "gpt2":
        kw = dict(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=256)
    if model_type in ("mixtral", "phimoe"):  # experts stored fused, [experts, out, in]
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    if model_type == "gpt_oss":  # experts stored fused and transposed, [experts, in, out], with biases
        kw.update(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2))
    if model_type == "zamba2":  # Mamba-2 blocks, then two hybrid blocks sharing (tying) one transformer block
        kw.update(layers_block_type=["mamba"] + ["hybrid"] * (layers - 1), mamba_d_state=16, mamba_headdim=16,
                  n_mamba_heads=8, num_mem_blocks=1)
    if model_type == "zaya":   # every block returns its residual stream beside its hidden states, handed to the next
        kw.update(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32, head_dim=16, router_hidden_size=32)
    if model_type == "bamba":  # Mamba-2 blocks with one attention block between them
        kw.update(attn_layer_indices=[1])
    if model_type == "gemma3":  # multimodal: a Gemma 3 text decoder and a one-layer SigLIP vision tower
        text = dict(kw, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
        kw = dict(text_config=text, mm_tokens_per_image=4,
                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=28, patch_size=14))
    if model_type == "llama4_text":  # experts stacked [experts, in, out], every token through all of them (bmm)
        kw.update(head_dim=16, num_local_experts=4, intermediate_size_mlp=inter)
    if model_type == "dbrx":  # experts stacked in 2-D parameters [experts·ffn, hidden], one slice each
        kw = dict(vocab_size=vocab, d_model=hidden, n_heads=4, n_layers=layers, max_seq_len=256,
                  attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                  ffn_config=dict(ffn_hidden_size=inter, moe_num_experts=4, moe_top_k=2))
    if model_type == "gemma3n_text":  # AltUp: blocks take their hidden states as [altup, batch, L, d]
        # the last layer reuses the keys and values the one before stores (KV sharing)
        kw.update(head_dim=16, sliding_window=8, num_kv_shared_layers=1, layer_types=["sliding_attention"] * layers,
                  activation_sparsity_pattern=[0.0] * layers, vocab_size_per_layer_input=vocab,
                  hidden_size_per_layer_input=16, laurel_rank=16)
    if model_type == "bloom":  # ALiBi, fused query_key_value, LayerNorms
        kw = dict(vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=4)
    return AutoConfig.for_model(model_type, **kw)


def tiny_model(model_type: str = "llama", seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **kw))
    return model.eval()


def random_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    paras = []
    while n_words > 0:
        k = min(n_words, rng.randint(30, 80))
        paras.append(" ".join(rng.choice(WORDS) for _ in range(k)))
        n_words -= k
    return "\n\n".join(paras)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Tests write their cache into a temp dir, except the embedded-model cache which is reused."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _kernels_checked():
    """Fail a test whose interpreted Triton kernels touched memory outside their tensors or had two programs
    store to one address, even where the code under test caught the error (``interpret_checks``: on a GPU
    an illegal address, or a race)."""
    before = len(_kernel_violations)
    yield
    found = _kernel_violations[before:]
    assert not found, f"{len(found)} kernel check failures, first: {found[0]}"


# the tests of the kernels and their wrappers run with uninitialized memory poisoned (interpret_checks)
POISONED_MODULES = ("test_kernels", "test_experts", "test_stacked_experts", "test_input_gather", "test_cslt_layout")


@pytest.fixture(autouse=True)
def _empties_poisoned(request):
    """In :data:`POISONED_MODULES`, ``torch.empty`` and its kin give NaN (or the largest integer), so a kernel
    reading memory no one wrote fails its comparison instead of reading the zeros fresh memory often holds."""
    if KERNELS_CHECKED and request.module.__name__.rsplit(".", 1)[-1] in POISONED_MODULES:
        from interpret_checks import poisoned_empties

        with poisoned_empties():
            yield
    else:
        yield


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    """A saved tiny LLaMA + tokenizer, loadable by path like any HF checkpoint."""
    path = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "calib.txt"
    path.write_text(random_text(6000, seed=1))
    return path


@pytest.fixture
def eval_file(tmp_path: Path) -> Path:
    path = tmp_path / "heldout.txt"
    path.write_text(random_text(3000, seed=2))
    return path


def fake_hub_datasets(monkeypatch, splits: dict[str, dict[str, list]]) -> list:
    """``datasets`` answering for one hub dataset with these splits (columns → values); the calls made."""
    import datasets

    import shuffleprune.hub

    calls = []
    monkeypatch.setattr(shuffleprune.hub, "hub_reachable", lambda *a, **k: True)
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda repo, config=None: list(splits))

    def load_dataset(repo, config=None, split=None, streaming=False):
        calls.append((repo, config, split, streaming))
        return datasets.Dataset.from_dict(splits[split]).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def flat_config(**options):
    """A ``PruneConfig`` from the command line's option names, as the tests of single methods want it:
    no permutation unless one is asked for and no weight update (built on `balanced`, the default minus its update)."""
    from shuffleprune.prune import PruneConfig

    if "perm" not in options and "perm_from" not in options:
        options["perm"] = "none"
    return PruneConfig.build("balanced", **options)


@pytest.fixture
def local_hub(tmp_path: Path, monkeypatch):
    """An offline hub cache under ``tmp_path``: ``publish(repo, src)`` makes the directory ``src``
    the cached snapshot of hub repo ``repo``, as a download would."""
    import shutil

    import huggingface_hub.constants

    cache, commit = tmp_path / "hub-cache", "0" * 40
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def publish(repo: str, src: Path) -> Path:
        root = cache / f"models--{repo.replace('/', '--')}"
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text(commit)
        shutil.copytree(src, root / "snapshots" / commit)
        return root / "snapshots" / commit
    return publish


@pytest.fixture
def tiny_task(tmp_path: Path) -> Path:
    """A 3-way multiple-choice lm-eval task over the tiny tokenizer's words, in its own directory."""
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    rng = random.Random(0)
    with open(task_dir / "tiny_mc.jsonl", "w") as fh:
        for _ in range(16):
            fh.write(json.dumps({"question": " ".join(rng.choice(WORDS) for _ in range(6)),
                                 "choices": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(3)],
                                 "gold": rng.randrange(3)}) + "\n")
    (task_dir / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {task_dir / 'tiny_mc.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 3.0
""")
    return task_dir
