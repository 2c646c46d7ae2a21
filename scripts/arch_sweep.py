"""Which Hugging Face decoder families go through prune → export → load unchanged, on tiny random models.

    .venv/bin/python scripts/arch_sweep.py                          # every family below, CPU, ~10 min
    .venv/bin/python scripts/arch_sweep.py --types llama bloom      # some of them

For each ``model_type`` a random model of 2 blocks (hidden 64, 4 heads, 2 KV heads, MLP 128) is built
from its transformers config, with a word-level tokenizer and a text of random words (nothing is
downloaded), pruned to 2:4 with ``--recipe`` (learned index maps by default, so the maps' folding
and their move to the norms are exercised) and exported; the export is loaded with the maps in the
layers and at their producers, and for MoE models once more with the experts run by the grouped
kernel (``kernel_grouped_experts``, interpreted). A family passes when all give the pruned model's
logits (max absolute difference ≤ 1e-5 of the largest logit, or ≤ 4× what float32 rounding alone moves
them against a float64 copy: CPMAnt's hidden states reach 650, Gemma 4's logits stay below 1). Each row records that difference, the pruned and compressed layer
counts (and the experts' matrices of MoE layers, fused or stacked in the model's own parameters,
pruned in place and compressed by the export, how many of those read their input through their own
index map, and how many pruned matrices the export had to keep dense),
the share of the blocks' weights left outside ``nn.Linear`` layers and experts, the time, or the
error. Results: ``scripts/results/arch_sweep.json`` (rewritten after every family).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("TRITON_INTERPRET", "1")   # the grouped experts kernel runs on the CPU (before triton loads)

TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "falcon",
         "gpt_neox", "gptj", "opt", "bloom", "olmo", "olmo2", "cohere", "granite", "stablelm", "starcoder2",
         "glm", "glm4", "smollm3", "exaone4", "helium", "ministral", "seed_oss", "arcee", "apertus",
         "hunyuan_v1_dense", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2", "olmoe", "phimoe",
         "granitemoe", "glm4_moe", "ernie4_5_moe", "gpt_oss", "mpt", "codegen", "xglm", "biogpt", "persimmon",
         "nemotron", "llama4_text", "recurrent_gemma", "dbrx", "minimax", "hunyuan_v1_moe", "dots1",
         "gpt2", "openai-gpt",   # Conv1D layers, held as nn.Linear
         # hybrids of attention and state-space / linear-attention blocks, and a pure Mamba
         "jamba", "bamba", "falcon_h1", "lfm2", "qwen3_next", "granitemoehybrid", "zamba2", "mamba",
         "gemma3", "llama4",   # multimodal checkpoints (text decoder and vision tower)
         "gemma3n_text",       # AltUp: hidden states [altup, batch, L, d]; KV sharing between blocks
         # added in the twenty-third session: families transformers 5.24 has that were not swept before
         "afmoe", "apertus1p5_text", "aria_text", "bitnet", "cohere2", "cohere2_moe", "cwm", "deepseek_v32",
         "deepseek_v4", "diffllama", "doge", "dots3_note_text", "ernie4_5", "exaone", "exaone_moe", "falcon_mamba",
         "flex_olmo", "gemma4_text", "glm4_moe_lite", "glm_moe_dsa", "gpt_bigcode", "gpt_neo", "granite_swa",
         "granitemoe_swa", "granitemoeshared", "hy_v3", "internlm3", "jais2", "jetmoe", "minicpm3", "minimax_m2",
         "ministral3", "nanochat", "nemotron_h", "olmo3", "olmo_hybrid", "sarvam_mla", "sarvam_moe", "solar_open",
         "vaultgemma", "laguna", "mellum", "iquestcoder", "hyperclovax",
         # added in the twenty-fourth session: hybrids and MLA families whose default tiny config did not fit
         "kimi_linear", "qwen3_5_text", "qwen3_5_moe_text", "lfm2_moe", "longcat_flash", "youtu", "zaya", "mamba2",
         "axk1", "axk2", "bailing_hybrid", "ctrl", "dory", "flint", "gemma4_unified_text", "gpt_neox_japanese", "hrm_text",
         "hy_v4", "inkling_text", "inkling2_text", "inkling2_loop_text", "kolibri1", "lara_mini", "lfm3", "mimo_v2_flash",
         "minimax_m3_vl_text", "modernbert-decoder", "qwen4_exp_text", "rwkv", "xlstm", "cpmant",
         "gemma4", "qwen3_5", "qwen3_5_moe", "qwen4_exp",   # multimodal checkpoints
         # added in the thirty-fifth session: decoders of transformers 5.24 not swept before
         "zamba", "beam", "cohere_compass_text",
         # added in the thirty-sixth session: the decoders transformers 5.25 adds (left out, with a line, on an older one)
         "ergo", "kolibri1_1", "minicpm5_moe", "param2moe"]
SIZE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=0, eos_token_id=0)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
# MLA attention (DeepSeek-V3's sizes) with DeepSeek's sparse-attention indexer, every head its own KV head
DSA = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
           kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
           n_group=1, topk_group=1, num_key_value_heads=4, index_n_heads=4, index_head_dim=16)
# the expert, shared-expert and MLA sizes under the names the newer MoE families use (a family ignores the others)
SMALL_MOE = dict(num_experts=4, n_routed_experts=4, num_local_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
                 shared_expert_intermediate_size=64, moe_shared_expert_intermediate_size=64, expert_ffn_hidden_size=32,
                 kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=16,
                 n_group=1, topk_group=1, sliding_window=8)
# MLA attention at the sizes above, every head its own KV head
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4)
# gated-delta-net linear attention (Qwen3.5, Kimi Linear), one linear-attention and one attention block
LINEAR_ATTN = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=16, linear_num_heads=4)
# what a family's config needs beyond SIZE to be that small (head sizes, expert counts, its own key names)
EXTRA = {
    "gemma": dict(head_dim=16), "gemma2": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
    "gemma3_text": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
    "helium": dict(head_dim=16), "ministral": dict(head_dim=16), "hunyuan_v1_dense": dict(head_dim=16),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64), "bloom": dict(n_layer=2, n_head=4),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        n_group=1, topk_group=1),
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        n_group=1, topk_group=1),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2), "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                     n_group=1, topk_group=1, head_dim=16),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
    "codegen": dict(rotary_dim=8), "bamba": dict(attn_layer_indices=[1]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2),   # one Mamba and one attention block of other classes
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=16, mamba_headdim=16, n_mamba_heads=8),
    "hunyuan_v1_moe": dict(head_dim=16, num_experts=4, moe_topk=2, moe_intermediate_size=32),
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, head_dim=16),
    "granitemoehybrid": dict(num_local_experts=4, num_experts_per_tok=2),
    # multimodal checkpoints that load as causal LMs: the text decoder is pruned, the vision tower left as it is
    "gemma3": dict(text_config=dict(SIZE, head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
                   vision_config=VISION, mm_tokens_per_image=4),
    "llama4": dict(text_config=dict(SIZE, head_dim=16, num_local_experts=4, intermediate_size_mlp=128),
                   vision_config=dict(VISION, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)),
    "gemma3n_text": dict(head_dim=16, sliding_window=8, num_kv_shared_layers=1, laurel_rank=16,   # block 1 reuses 0's K/V
                         layer_types=["sliding_attention"] * 2, activation_sparsity_pattern=[0.0, 0.0],
                         vocab_size_per_layer_input=256, hidden_size_per_layer_input=16),
    "deepseek_v32": dict(DSA), "glm_moe_dsa": dict(DSA),
    "dots3_note_text": dict(DSA, shared_experts_intermediate_size=64, head_dim=16, sliding_window=8),
    "minicpm3": dict(num_key_value_heads=4),   # MLA: every head its own KV head
    "gpt_neo": dict(num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]]),
    **{t: dict(SMALL_MOE) for t in ("hy_v3", "minimax_m2", "nemotron_h", "sarvam_mla", "sarvam_moe", "solar_open",
                                    "laguna", "mellum", "axk1", "axk2", "bailing_hybrid", "flint", "hy_v4", "inkling_text",
                                    "inkling2_text", "inkling2_loop_text", "kolibri1", "lara_mini", "mimo_v2_flash",
                                    "minimax_m3_vl_text", "param2moe")},
    # KV sharing (Gemma 4 E2B/E4B): the last block reuses the keys and values block 1 stores; 3 blocks, as
    # both attention types must store before one reuses, and the last block must be full attention
    "gemma4_text": dict(num_hidden_layers=3, num_kv_shared_layers=1,
                        layer_types=["sliding_attention", "full_attention", "full_attention"]),
    "kimi_linear": dict(SMALL_MOE, **MLA, **LINEAR_ATTN, num_experts_per_token=2, head_dim=16),
    "qwen3_5_text": dict(LINEAR_ATTN, head_dim=16),
    "qwen3_5_moe_text": dict(SMALL_MOE, **LINEAR_ATTN),
    "lfm2_moe": dict(SMALL_MOE, layer_types=["conv", "full_attention"], num_dense_layers=1),
    "longcat_flash": dict(SMALL_MOE, **MLA, num_layers=2, moe_topk=2, zero_expert_num=2, head_dim=8),   # head_dim: the rope part
    "youtu": dict(MLA),
    "zaya": dict(SMALL_MOE, num_experts_per_tok=1),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, time_step_rank=8),
    "qwen4_exp_text": dict(SMALL_MOE, **{**LINEAR_ATTN, "layer_types": ["linear_attention", "indexed_attention"]},
                           indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4),   # QSA: a token indexer on the attention block
    "axk1": dict(SMALL_MOE, **MLA, head_dim=8),   # head_dim: the rope part
    "axk2": dict(SMALL_MOE, **MLA, head_dim=8, index_n_heads=4, index_head_dim=16),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"], mamba_dt_rank=8),   # one attention block shared by both hybrids
    # its config comes without the rope parameters its rotary embedding reads per attention type
    "cohere_compass_text": dict(rope_parameters={t: dict(rope_type="default", rope_theta=10000.0)
                                                 for t in ("full_attention", "sliding_attention")}),
    "cpmant": dict(dim_ff=128, dim_head=16),   # its own names for the MLP and head sizes (was 10240 × 128)
    **{t: dict(SMALL_MOE, unpadded_vocab_size=256, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16)
       for t in ("inkling2_text", "inkling2_loop_text")},
    # transformers 5.25's: Ergo's first block a dense MLP of its own size, then experts with a shared one; Kolibri 1.1
    # indexed attention (its indexer on block 0, block 2 reading block 0's keys and values) and sliding attention
    "ergo": dict(SMALL_MOE, first_dense_intermediate_size=128, shared_intermediate_size=64, global_attention_every_n_layers=2),
    "kolibri1_1": dict(SMALL_MOE, num_hidden_layers=3, layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
                       index_num_heads=2, index_topk=8, index_pool_size=32, index_compression=4, index_num_local_tokens=4,
                       index_num_sink_tokens=2, mlp_only_intermediate_size=128),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                  first_k_dense_replace=1, n_group=1, topk_group=1, layer_types=["full_attention"] * 2),
}
# multimodal checkpoints of families swept above as text models: their text config inside, a one-layer vision tower
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=64)
EXTRA.update({"gemma4": dict(text_config=dict(SIZE, **EXTRA["gemma4_text"])),
              **{t: dict(text_config=dict(SIZE, **EXTRA[f"{t}_text"]), vision_config=QWEN_VISION)
                 for t in ("qwen3_5", "qwen3_5_moe", "qwen4_exp")}})


def float32_noise(model, ids) -> float | None:
    """How far float32 arithmetic alone moves ``model``'s logits on ``ids``: the largest difference to a
    float64 copy's (None where a family's code cannot run in float64)."""
    import copy

    import torch

    try:
        with torch.no_grad():
            return float((model(ids).logits.double() - copy.deepcopy(model).double()(ids).logits).abs().max())
    except Exception:  # noqa: BLE001 - XGLM's mask value overflows float32's range in float64
        return None


def agrees(diff: float, reference, noise: float | None) -> bool:
    """The pass rule of both sweeps: an export's logits within 1e-5 of the reference's largest logit, or
    within 4× what float32 rounding alone moves them (models whose hidden states dwarf their logits)."""
    return diff <= max(1e-5 * float(reference.abs().max()), 4 * (noise or 0.0))


HALF_TOLERANCE = 0.05   # a half-precision load: within this share of the reference's largest logit (rounding only)


def half_precision_diff(pruned: Path, exported: Path, dtype: str, ids) -> float | str:
    """The export loaded in ``dtype`` against the pruned checkpoint loaded in it, on ``ids``: the largest logit
    difference relative to the reference's largest logit (a load that leaves a tensor in another dtype fails);
    the reason, where the pruned checkpoint itself (a plain transformers model) cannot run in ``dtype``."""
    import torch

    import shuffleprune
    from shuffleprune.models import load_model

    with torch.no_grad():
        try:
            want = load_model(str(pruned), dtype).model.eval()(ids).logits   # (Mamba's are float32 in any dtype)
        except RuntimeError as exc:   # e.g. a module the family keeps in float32 beside float16 ones
            return f"the pruned checkpoint itself fails in {dtype}: {exc}"[:300]
        got = shuffleprune.load(str(exported), dtype=dtype)(ids).logits
    if got.dtype != want.dtype:
        raise TypeError(f"the export loaded in {dtype} computed {got.dtype} logits, the pruned checkpoint {want.dtype}")
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def one_family(model_type: str, recipe: str, perm: str, tmp: Path, seed: int, dtype: str | None = None) -> dict:
    """Prune, export and reload one family; the row of results."""
    import random

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import shuffleprune
    from bench_stage_cost import word_tokenizer
    from shuffleprune.deploy.export import export_checkpoint
    from shuffleprune.deploy.sparse_experts import set_experts_mode
    from shuffleprune.deploy.sparse_linear import SparseLinear
    from shuffleprune.models import load_model
    from shuffleprune.prune import PruneConfig, prune

    torch.manual_seed(seed)
    src = tmp / model_type
    config = AutoConfig.for_model(model_type, **{**SIZE, **EXTRA.get(model_type, {})})
    AutoModelForCausalLM.from_config(config).save_pretrained(src)
    tokenizer = word_tokenizer(SIZE["vocab_size"] - 1)
    tokenizer.save_pretrained(src)
    lm = load_model(str(src))
    lm.tokenizer = tokenizer   # AutoTokenizer would rebuild it as the family's own class (Qwen2's drops the words)
    rng = random.Random(seed)
    text = tmp / "text.txt"
    text.write_text("\n\n".join(" ".join(f"w{rng.randrange(255)}" for _ in range(60)) for _ in range(80)))
    extra = {"perm": perm, "perm_steps": 2, "perm_block": 16} if perm == "learned" else {"perm": perm}
    cfg = PruneConfig.build(recipe, model=str(src), pattern="2:4", calib=str(text), nsamples=4, seqlen=32,
                            batch_size=3, eval_text=None, seed=seed, **extra)
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = prune(cfg, out=tmp / "pruned", progress=False, loaded=lm)
    fmt = export_checkpoint(tmp / "pruned", tmp / "exported")
    ref = load_model(str(tmp / "pruned")).model.eval()
    ids = torch.randint(1, SIZE["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(seed))
    diffs, compressed, experts, mapped = {}, 0, 0, 0
    with torch.no_grad():
        want = ref(ids).logits
        for maps in ("kernel", "producer"):
            model = shuffleprune.load(str(tmp / "exported"), maps=maps)
            held = [h for m in model.modules() for h in getattr(m, "nm_experts", {}).values()]
            experts, mapped = sum(len(h) for h in held), sum(sum(h.mapped) for h in held)
            compressed = sum(isinstance(m, SparseLinear) for m in model.modules())   # experts' views are not modules
            diffs[maps] = float((model(ids).logits - want).abs().max())
            if experts and maps == "kernel":   # the experts again by the grouped kernel (interpreted on the CPU)
                set_experts_mode(model, "grouped")
                diffs["kernel_grouped_experts"] = float((model(ids).logits - want).abs().max())
    noise = float32_noise(ref, ids)
    half = {} if dtype is None else {f"{dtype}_rel_logit_diff": half_precision_diff(tmp / "pruned", tmp / "exported",
                                                                                   dtype, ids)}
    return {"model_type": model_type, **half,   # (a reason instead of a difference: the family itself cannot run so)
            "ok": agrees(max(diffs.values()), want, noise) and all(isinstance(v, str) or v <= HALF_TOLERANCE
                                                                   for v in half.values()),
            "max_abs_logit_diff": diffs,
            "max_rel_logit_diff": max(diffs.values()) / float(want.abs().max()), "float32_noise": noise,
            "pruned_layers": len(result.report["layers"]), "nm_ok": result.report["nm_ok"],
            "pruned_experts": sum(bool(l.get("expert")) for l in result.report["layers"]),
            "compressed_layers": compressed, "compressed_experts": experts, "kept_dense": len(fmt["kept_dense"]),
            "experts_with_maps": mapped, "folded_maps": len(fmt["folded"]), "gating_linears": len(result.report["gating_linears"]),
            "outside_linears_share": result.report["outside_linears"]["share"],
            "seconds": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--recipe", default="accurate")
    ap.add_argument("--perm", default="learned")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "arch_sweep.json"))
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default=None,
                    help="also load the export and the pruned checkpoint in this dtype and compare (within "
                         f"{HALF_TOLERANCE} of the largest logit)")
    args = ap.parse_args()

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from shuffleprune.runtime.facts import machine, versions

    missing = [t for t in args.types if t not in CONFIG_MAPPING]   # families of a newer transformers than this one
    if missing:
        print(f"not in this transformers, left out: {' '.join(missing)}")

    result = {"what": "prune → export → load on tiny random models of each transformers decoder family "
                      "(2:4, logits of the export against the pruned checkpoint; a family passes within 1e-5 of its "
                      "largest logit or 4× the float32-vs-float64 difference of the checkpoint's)",
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "seed": args.seed,
              "recipe": args.recipe, "perm": args.perm, "model": {k: v for k, v in SIZE.items() if "token" not in k},
              "data": "random words, 4 windows × 32 tokens", "machine": machine(), "versions": versions(),
              **({"half_precision": f"also loaded in {args.dtype}: export against pruned checkpoint within "
                                    f"{HALF_TOLERANCE} of its largest logit (a reason where the pruned checkpoint "
                                    f"itself cannot run in {args.dtype})"} if args.dtype else {}),
              **({"left_out": {"types": missing, "why": "not in the transformers that ran"}} if missing else {})}
    sweep([t for t in args.types if t not in missing],
          lambda model_type, tmp: one_family(model_type, args.recipe, args.perm, tmp, args.seed, args.dtype),
          result, Path(args.out))


def sweep(types: list[str], one: Callable[[str, Path], dict], result: dict, out: Path) -> None:
    """``one(model_type, tmp_dir)`` for each family in a fresh temporary directory, a failure as a row with
    its error; ``result["rows"]`` and ``result["passed"]`` rewritten to ``out`` after every family."""
    import transformers

    rows = result["rows"] = []
    for model_type in types:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                row = one(model_type, Path(tmp))
            except Exception as exc:   # a family that fails is a row, not the end of the sweep
                row = {"model_type": model_type, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500],
                       "where": traceback.format_exc().strip().splitlines()[-3].strip()[:300]}
        rows.append(row)
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {model_type:18s} "
              f"{row.get('max_abs_logit_diff', row.get('error'))}", flush=True)
        result["passed"] = sum(r["ok"] for r in rows)
        out.write_text(json.dumps(result, indent=1))
    print(f"{result['passed']}/{len(rows)} families pass (transformers {transformers.__version__}); wrote {out}")


if __name__ == "__main__":
    main()
