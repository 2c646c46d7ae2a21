"""A ``.gguf`` file as an ordinary HF checkpoint: dequantized once by transformers (its tokenizer's special
tokens checked against the file's metadata) and cached by the file's contents."""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shuffleprune.cache import cache_dir
from shuffleprune.errors import UserError, reason
from shuffleprune.runtime.facts import transformers_release


def gguf_token_id(path: Path, key: str) -> int | None:
    """The token id a GGUF file's metadata gives under ``key`` (``tokenizer.ggml.eos_token_id`` …), or None."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get(key)
    if field is None or not field.data:
        return None
    return int(field.parts[field.data[0]][0])


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into a normal HF safetensors checkpoint at ``out_dir`` (atomic).

    Two known pitfalls of transformers' GGUF conversion are handled: the tokenizer's eos/pad
    tokens are checked against the GGUF metadata and corrected, and the GGUF quantizer that
    transformers attaches (which makes ``save_pretrained`` refuse) is detached.
    """
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, use_kernels=False)
    for attr, key in (("eos", "tokenizer.ggml.eos_token_id"), ("pad", "tokenizer.ggml.padding_token_id"),
                      ("bos", "tokenizer.ggml.bos_token_id")):
        want = gguf_token_id(gguf_path, key)
        if want is None:
            continue
        if getattr(tokenizer, f"{attr}_token_id") != want:
            setattr(tokenizer, f"{attr}_token", tokenizer.convert_ids_to_tokens(want))
        setattr(model.config, f"{attr}_token_id", want)
        if model.generation_config is not None:
            setattr(model.generation_config, f"{attr}_token_id", want)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Detach the GGUF quantizer: the weights are already dequantized, plain tensors.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():  # not a concurrent conversion that won the race
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_FINGERPRINT_SPAN = 4 << 20  # bytes hashed at each end of a GGUF file


def gguf_fingerprint(gguf_path: Path) -> str:
    """A key for a GGUF file's contents, not its location: SHA-256 of its size, its first 4 MiB (the
    header: metadata and the tensor table) and its last 4 MiB. Copies of one file at different paths
    (one per virtualenv) share one converted directory; a different file gets its own."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_FINGERPRINT_SPAN))
        if size > _FINGERPRINT_SPAN:
            f.seek(max(_FINGERPRINT_SPAN, size - _FINGERPRINT_SPAN))
            digest.update(f.read())
    return digest.hexdigest()[:12]


def gguf_as_hf_dir(gguf_path: Path, label: str | None = None) -> Path:
    """Cached HF directory for a GGUF file (converted on first use), keyed by its contents and by the
    major version of transformers that converts it: the saved tokenizer files of one major cannot be
    read by another (transformers 5 names a class 4.x lacks), and virtualenvs share one cache."""
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"'{gguf_path}' is not a GGUF file (it does not begin with GGUF's magic bytes); give a "
                            ".gguf file written by llama.cpp's tools, or a HF model dir")
    out = (cache_dir() / "models"
           / f"{label or gguf_path.stem}-{gguf_fingerprint(gguf_path)}-transformers{transformers_release()[0]}")
    if not (out / "config.json").is_file():
        try:
            convert_gguf(gguf_path, out)
        except (ValueError, KeyError, IndexError, NotImplementedError, struct.error) as exc:
            # a file cut short, an architecture or a quantization it cannot read
            raise UserError(f"cannot read '{gguf_path}' as a model ({reason(exc, 160)}): the file is cut short, or "
                            "transformers does not convert its architecture or quantization; give the model's HF "
                            "checkpoint instead") from exc
    return out
