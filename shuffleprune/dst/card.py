"""The model card (``README.md``) a ``dst`` run writes beside its trained model."""
from __future__ import annotations

from shuffleprune.calib import held_out_part
from shuffleprune.report import ppl_change


def model_card(report: dict) -> str:
    """A hub-style ``README.md`` for ``OUT/model``: how it was trained, its perplexity, how to load it."""
    train, dst = report["train"], report["dst"]
    method = dst["method"]
    structure = f"{dst['pattern']} (N:M)" if method == "nm" else f"{1 - report['density']:.0%} sparse"
    perms = sum(1 for p in report["permutations"].values() if p.get("strength") is not None)
    arch = train["arch"] + (f" ({', '.join(f'{k}={v}' for k, v in train['config_kw'].items())})"
                            if train["config_kw"] else "")
    perm_line = (f"- Learned input permutations (`--perm {dst['perm']}`): {perms} layers, their index maps in "
                 "`index_maps.safetensors`; the weights are stored in their inputs' own column order, so the model "
                 "loads as it is.\n" if perms else "")
    text = report.get("text")   # (reports before 2026-12-01 lack it)
    text_line = f" ({text['train_tokens']} tokens to train on, read {text['passes']:g} times)" if text else ""
    from shuffleprune.models import trust_snippets

    # the architecture's own code, kept beside the weights, runs only when trusted
    trust_arg, trust_flag = trust_snippets(train.get("trust_remote_code", False))
    export_line = (f"For a compressed N:M copy: `shuffleprune export PATH DEPLOYED{trust_flag}` (reads "
                   "`../dst_report.json`).\n" if method == "nm" else "")
    if train.get("init") is not None:
        return _finetuned_card(report, text_line, trust_arg, trust_flag)
    return f"""---
library_name: transformers
tags:
- shuffleprune
- sparse
- dynamic-sparse-training
---

# {method} · {structure}

Trained from scratch with [shuffleprune](https://pypi.org/project/shuffleprune/) `dst`
(dynamic sparse training, method `{method}`), {train['steps']} steps on `{train['data']}`{text_line},
seed {train['seed']}.

- Architecture: {arch}; tokenizer `{train['tokenizer']}`.
- Density of the sparsified layers: {report['density']:.4f}; held-out perplexity at the end:
  {report['final_ppl']:.2f} ({held_out_part(train['data'], split_from_shared=True)}, windows of {train['seq_len']} tokens).
{perm_line}
## Load it

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("PATH"{trust_arg})
```

{export_line}"""


def _finetuned_card(report: dict, text_line: str, trust_arg: str, trust_flag: str) -> str:
    """The card of a fine-tuned pruned checkpoint (``shuffleprune finetune``)."""
    train = report["train"]
    carried = report.get("carried") or []
    export_line = (f"For a compressed N:M copy: `shuffleprune export PATH DEPLOYED{trust_flag}` (reads the pruning "
                   "run's `prune_report.json`, kept here).\n" if "prune_report.json" in carried else "")
    maps_line = ("- The pruned checkpoint's index maps are kept in `index_maps.safetensors`; the weights are stored "
                 "in their inputs' own column order, so the model loads as it is.\n"
                 if "index_maps.safetensors" in carried else "")
    return f"""---
library_name: transformers
tags:
- shuffleprune
- sparse
- fine-tuned
---

# Fine-tuned pruned model · density {report['density']:.4f}

The pruned checkpoint `{train['init']}` fine-tuned with [shuffleprune](https://pypi.org/project/shuffleprune/)
`finetune`: its zeros held at every step, so its sparsity pattern is unchanged; {train['steps']} steps on
`{train['data']}`{text_line}, learning rate {train['lr']:g}, seed {train['seed']}.

- Held-out perplexity before → after: {ppl_change(report)} ({held_out_part(train['data'], split_from_shared=True)}, windows of
  {train['seq_len']} tokens).
{maps_line}
## Load it

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("PATH"{trust_arg})
```

{export_line}"""
