import pytest
import torch

from conftest import tiny_model
from shuffleprune.block_inputs import capture_block_inputs, run_block
from shuffleprune.blocks import block_linears, find_blocks, model_linears
from shuffleprune.prune.input_stats import collect_input_stats, input_groups
from shuffleprune.runtime.memory import module_bytes

ARCHS = ["llama", "mistral", "qwen2", "gemma2", "gemma3_text"]


@pytest.mark.parametrize("arch", ARCHS)
def test_blocks_found_and_replayed_exactly(arch):
    """Running the captured block-0 inputs through the blocks one by one, with the captured
    per-block arguments (masks incl. sliding windows, rotary embeddings), gives the model's own
    hidden states — for every architecture, without looking at its name."""
    model = tiny_model(arch)
    blocks = find_blocks(model)
    assert len(blocks) == 3
    linears = block_linears(blocks.layers[0], blocks.prefix(0))
    assert len(linears) == 7 and all(n.startswith(blocks.name + ".0.") for n in linears)
    tokens = torch.randint(0, 128, (5, 24), generator=torch.Generator().manual_seed(0))
    captured = capture_block_inputs(model, blocks, tokens, torch.device("cpu"), batch_size=2)
    assert captured.hidden.shape == (5, 24, 64)
    hidden, ref = _replay_matches_the_model(model, blocks, captured, tokens)
    # the last entry of hidden_states is after the final norm
    assert torch.allclose(model.get_decoder().norm(hidden), ref[-1], atol=1e-5)



def test_model_linears_lists_every_block_in_order_with_the_globs():
    """``model_linears``: every block's linears under its full name, block by block, ``--only`` /
    ``--skip`` applied; ``module_bytes`` counts parameters and buffers at their element sizes."""
    model = tiny_model("llama")
    blocks = find_blocks(model)
    every = model_linears(blocks)
    assert len(every) == 7 * len(blocks)
    assert [n.split(".")[2] for n in every] == [str(i) for i in range(len(blocks)) for _ in range(7)]
    assert all(every[n] is model.get_submodule(n) for n in every)
    only = model_linears(blocks, only=["*.mlp.*"], skip=["*.2.*"])
    assert sorted(only) == sorted(n for n in every if ".mlp." in n and f"{blocks.name}.2." not in n)
    floats = sum(t.numel() for t in (*model.parameters(), *model.buffers()))   # all float32 here
    assert module_bytes(model) == 4 * floats
    model.register_buffer("extra", torch.zeros(3, dtype=torch.float16))
    assert module_bytes(model) == 4 * floats + 6

def _replay_matches_the_model(model, blocks, captured, tokens):
    """Run the captured block-0 inputs through every block with its captured arguments, 3 windows at a
    time (and the remainder), checking each block's input against the model's own hidden states;
    the last block's output and those hidden states."""
    with torch.no_grad():
        ref = model(input_ids=tokens, output_hidden_states=True, use_cache=False).hidden_states
    hidden = captured.hidden
    for i in range(len(blocks)):
        assert torch.allclose(hidden, ref[i], atol=1e-5), f"block {i} input differs"
        hidden = run_block(blocks.layers[i], hidden, captured, i, torch.device("cpu"), batch_size=3)
    return hidden, ref


@pytest.mark.parametrize("arch", ["xglm", "bamba", "zamba2"])
def test_blocks_that_check_the_mask_batch_return_longer_tuples_or_take_window_data_are_replayed(arch):
    """XGLM checks that its mask is ``[batch, 1, L, L]`` (one window's ``[1, …]`` is expanded per batch);
    Bamba's model unpacks two values from every block, which the capture's stand-ins answer as block
    0 does; Zamba2 passes its hybrid blocks each window's embeddings (recorded for every window, one
    copy for the blocks that share it). Replayed at batches of 3 and 2, the blocks give the model's
    own hidden states."""
    from shuffleprune.block_args import window_data

    model = tiny_model(arch)
    blocks = find_blocks(model)
    tokens = torch.randint(0, 128, (5, 24), generator=torch.Generator().manual_seed(0))
    captured = capture_block_inputs(model, blocks, tokens, torch.device("cpu"), batch_size=2)
    assert captured.hidden.shape == (5, 24, 64)
    assert (captured.output_rest is None) == (arch != "bamba")
    data = [window_data((captured.args[i], captured.kwargs[i])) for i in range(len(blocks))]
    if arch == "zamba2":   # every block is given the embeddings: one record of all 5 windows
        assert all(len(d) == 1 and d[0] is data[0][0] for d in data)
        assert torch.cat(data[0][0].parts).shape == (5, 24, 64)
    else:
        assert not any(data)
    _replay_matches_the_model(model, blocks, captured, tokens)


def test_what_a_block_returns_and_the_model_hands_the_next_block_is_each_windows_own():
    """Zaya's blocks return a second stream beside their hidden states, and the model hands it to the next block
    (GLM-5's DSA does so with its indexer's top-k, Kolibri 1.1 with its index pool). Recorded on one window, it
    is marked as the previous block's return; replayed at batches of 3 and 2, each block reads that block's own
    answer for its windows, so the blocks give the model's own hidden states for every window, and a second
    stream (``with_own_states``) keeps its own."""
    from shuffleprune.block_args import Carried

    model = tiny_model("zaya")
    blocks = find_blocks(model)
    tokens = torch.randint(0, 128, (5, 24), generator=torch.Generator().manual_seed(0))
    captured = capture_block_inputs(model, blocks, tokens, torch.device("cpu"), batch_size=2)
    carried = [[a for a in captured.args[i] if isinstance(a, Carried)] for i in range(len(blocks))]
    assert carried[0] == [] and all(len(c) == 1 and c[0].producer == i - 1 for i, c in enumerate(carried) if i)
    assert captured.holds_shared_state()
    dense = captured.with_own_states()
    assert dense.carried is not captured.carried
    assert all(a.outputs is dense.carried for i in range(1, len(blocks)) for a in dense.args[i] if isinstance(a, Carried))
    _replay_matches_the_model(model, blocks, captured, tokens)
    cpu = torch.device("cpu")
    with torch.no_grad():   # the other stream, run in between on other inputs, leaves this one's returns alone
        ref = model(input_ids=tokens, output_hidden_states=True, use_cache=False).hidden_states
        first = run_block(blocks.layers[0], captured.hidden, captured, 0, cpu, batch_size=5)
        run_block(blocks.layers[0], captured.hidden.flip(0), dense, 0, cpu, batch_size=5)
        assert torch.allclose(run_block(blocks.layers[1], first, captured, 1, cpu, batch_size=5), ref[2], atol=1e-5)


def test_named_tuples_a_model_hands_its_blocks_stay_named_tuples():
    """A model may hand its blocks a named tuple (here the rotary ``(cos, sin)``, which a block could read by field):
    recorded and laid out for a batch, it is the same named tuple, and the replayed blocks give the model's own
    hidden states."""
    from collections import namedtuple

    Rope = namedtuple("Rope", "cos sin")
    model = tiny_model("llama")
    rope = model.get_decoder().rotary_emb
    forward = rope.forward
    rope.forward = lambda *a, **kw: Rope(*forward(*a, **kw))
    blocks = find_blocks(model)
    tokens = torch.randint(0, 128, (5, 24), generator=torch.Generator().manual_seed(0))
    captured = capture_block_inputs(model, blocks, tokens, torch.device("cpu"), batch_size=2)
    _, kwargs = captured.call_args(1, slice(0, 3), torch.device("cpu"))
    assert type(kwargs["position_embeddings"]) is Rope and kwargs["position_embeddings"].cos.shape[-2:] == (24, 16)
    _replay_matches_the_model(model, blocks, captured, tokens)


def test_blocks_taking_the_windows_along_another_dim_are_replayed():
    """Gemma 3n's AltUp hands its blocks ``[altup, batch, L, d]``: the capture finds the windows' dim
    from one window against two, keeps the windows along dim 0 and gives them back to the blocks in
    their own layout; replayed at batches of 3 and 2 (its per-layer inputs are each window's own
    data; its last block reuses the keys and values the one before stores, kept per window), the
    blocks give the model's own hidden states."""
    from shuffleprune.block_args import SharedState, window_data

    model = tiny_model("gemma3n_text")
    blocks = find_blocks(model)
    tokens = torch.randint(0, 128, (5, 24), generator=torch.Generator().manual_seed(0))
    captured = capture_block_inputs(model, blocks, tokens, torch.device("cpu"), batch_size=2)
    assert captured.batch_dim == 1 and captured.hidden.shape == (5, 4, 24, 64)
    assert all(window_data((captured.args[i], captured.kwargs[i])) for i in range(len(blocks)))
    # block 1 stores its keys and values for block 2 (KV sharing): one state handed to every block
    states = [[v for v in kw.values() if isinstance(v, SharedState)] for kw in captured.kwargs]
    assert all(len(s) == 1 and s[0] is states[0][0] for s in states) and captured.holds_shared_state()
    with torch.no_grad():
        ref = model(input_ids=tokens, output_hidden_states=True, use_cache=False).hidden_states
    hidden = captured.hidden
    for i in range(len(blocks)):
        assert torch.allclose(captured.to_block(hidden), ref[i], atol=1e-5), f"block {i} input differs"
        hidden = run_block(blocks.layers[i], hidden, captured, i, torch.device("cpu"), batch_size=3)
    single = capture_block_inputs(model, blocks, tokens[:1], torch.device("cpu"))
    assert single.batch_dim == 1 and torch.equal(single.hidden, captured.hidden[:1])   # one window: its size-1 dim


def test_arguments_laid_out_per_window_are_repeated_for_each_batch():
    """BLOOM passes its ALiBi bias as ``[batch·heads, 1, L]``, which does not broadcast from one window:
    it is recognised by recording two windows and repeated for every batch size the blocks are run at
    (3 and the remainder 2 here), and the replayed blocks give the model's own hidden states."""
    from shuffleprune.block_args import PerWindow

    model = tiny_model("bloom")
    blocks = find_blocks(model)
    tokens = torch.randint(0, 128, (5, 24), generator=torch.Generator().manual_seed(0))
    captured = capture_block_inputs(model, blocks, tokens, torch.device("cpu"), batch_size=2)
    per_window = [v for v in captured.kwargs[0].values() if isinstance(v, PerWindow) and v.one.shape[0] != 1]
    assert len(per_window) == 1 and per_window[0].one.shape == (4, 1, 24)   # heads × 1 × L
    args, kwargs = captured.call_args(0, slice(0, 3), torch.device("cpu"))
    assert [v.shape for v in kwargs.values() if isinstance(v, torch.Tensor) and v.shape[0] == 12] == [(12, 1, 24)]
    _replay_matches_the_model(model, blocks, captured, tokens)


def test_shared_inputs_are_grouped():
    model = tiny_model("llama")
    blocks = find_blocks(model)
    linears = block_linears(blocks.layers[0], "model.layers.0")
    tokens = torch.randint(0, 128, (2, 16))
    captured = capture_block_inputs(model, blocks, tokens, torch.device("cpu"))
    with collect_input_stats(linears, gram=False) as stats:
        run_block(blocks.layers[0], captured.hidden, captured, 0, torch.device("cpu"), 2)
    groups = [[n.split(".")[-1] for n in g] for g in input_groups(stats)]
    assert sorted(map(sorted, groups)) == sorted([["k_proj", "q_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]])
    assert stats["model.layers.0.self_attn.q_proj"].tokens == 32


def test_only_and_skip_globs():
    model = tiny_model("llama")
    block = find_blocks(model).layers[1]
    names = block_linears(block, "model.layers.1", only=["*mlp*"], skip=["*down_proj"])
    assert sorted(n.split(".")[-1] for n in names) == ["gate_proj", "up_proj"]


def test_conv1d_blocks_are_found():
    blocks = find_blocks(tiny_model("gpt2"))
    assert blocks.name == "transformer.h" and len(blocks) == 3


def test_linear_subclasses_are_layers_only_when_they_compute_a_linear_map():
    """A subclass of nn.Linear with its own forward is pruned when it computes x Wᵀ + b (Falcon's
    FalconLinear) and left alone otherwise (a MoE router returning its top-k choice, a scaled output)."""
    from torch import nn

    from shuffleprune.blocks import block_linears, is_plain_linear

    class MatmulLinear(nn.Linear):
        def forward(self, x):
            return x @ self.weight.T + self.bias

    class Router(nn.Linear):
        def forward(self, x):
            logits = super().forward(x)
            return logits, logits.topk(2, dim=-1).indices

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    block = nn.ModuleDict({"plain": nn.Linear(8, 4), "matmul": MatmulLinear(8, 4), "router": Router(8, 4),
                           "scaled": Scaled(8, 4)})
    assert [is_plain_linear(m) for m in block.values()] == [True, True, False, False]
    assert sorted(block_linears(block, "b")) == ["b.matmul", "b.plain"]


@pytest.mark.parametrize("arch", ARCHS + ["bloom", "mixtral", "gpt_oss", "xglm", "bamba", "zamba2", "gemma3n_text",
                                  "llama4_text", "dbrx"])
@pytest.mark.parametrize("bos", [None, 1])
def test_blockwise_perplexity_equals_the_whole_models(arch, bos):
    """Scoring one block at a time (for models larger than the device) gives the perplexity of the
    whole model's forward: same windows, the model's own code after the blocks (Gemma 2's final
    logit soft-cap included), BLOOM's ALiBi and the MoE layers alike."""
    from shuffleprune.evaluation.perplexity import perplexity

    model = tiny_model(arch)
    tokens = torch.randint(2, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    whole = perplexity(model, tokens, 32, batch_size=3, bos=bos)
    assert perplexity(model, tokens, 32, batch_size=3, bos=bos, blockwise=True) == pytest.approx(whole, rel=1e-5)


def test_perplexity_refuses_windows_that_predict_nothing():
    """A window of one token predicts none (ppl would divide by zero); two tokens, one with a BOS, is the least."""
    from shuffleprune.errors import UserError
    from shuffleprune.evaluation.perplexity import perplexity

    model = tiny_model("llama")
    tokens = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    for bos in (None, 1):
        with pytest.raises(UserError, match="at least 2 tokens"):
            perplexity(model, tokens, 1, bos=bos)
        assert perplexity(model, tokens, 2, bos=bos) > 1
