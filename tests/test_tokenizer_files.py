"""A checkpoint's tokenizer as its files say: read from ``tokenizer.json`` where a class rebuild encodes
otherwise, and written into every output as the source's own files."""
import warnings
from pathlib import Path

import pytest
from tokenizers import Tokenizer, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import shuffleprune
from shuffleprune.models import load_tokenizer
from shuffleprune.tokenizer_files import PROBE, as_its_file, save_tokenizer, tokenizer_folder
from conftest import make_tokenizer, random_text, tiny_model


class Rebuilt(PreTrainedTokenizerFast):
    """A model-specific class, as transformers 5 builds one from a ``model_type``."""


def _space_stripping() -> Rebuilt:
    """The same vocabulary with the spaces normalized away: huggingface/transformers#48206's symptom."""
    backend = make_tokenizer().backend_tokenizer
    backend.normalizer = normalizers.Replace(" ", "")
    return Rebuilt(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]", pad_token="[EOS]")


def _file_ids(folder: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def _saved(folder: Path, model_type: str = "qwen2") -> Path:
    tiny_model(model_type, layers=2).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def test_a_class_that_encodes_otherwise_than_its_file_gives_way_to_the_file(tmp_path):
    make_tokenizer().save_pretrained(tmp_path)
    text = random_text(40, seed=3)
    with pytest.warns(UserWarning, match=r"the tokenizer of 'ckpt': .* Rebuilt encodes text otherwise than its "
                                            r"tokenizer\.json"):
        tok = as_its_file(_space_stripping(), tmp_path, "ckpt")
    assert type(tok) is PreTrainedTokenizerFast
    assert tok(text, add_special_tokens=False)["input_ids"] == _file_ids(tmp_path, text)
    assert len(_file_ids(tmp_path, text)) == 40   # the file's: one id a word, where the rebuilt class ran them together
    assert (tok.eos_token, tok.pad_token, tok.unk_token) == ("[EOS]", "[EOS]", "[UNK]")


def test_a_class_that_encodes_as_its_file_is_kept_without_a_warning(tmp_path):
    make_tokenizer().save_pretrained(tmp_path)
    backend = make_tokenizer().backend_tokenizer
    same = Rebuilt(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]", pad_token="[EOS]")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_its_file(same, tmp_path, "ckpt") is same
        assert as_its_file(same, None, "in memory") is same   # nothing to compare with


def test_loaded_tokenizers_encode_as_their_tokenizer_json(tmp_path):
    """Whatever class transformers builds for a model type, what shuffleprune loads encodes as the file does
    (transformers 5.24 rebuilds this word-level file as a Qwen2 byte-level BPE that drops most words)."""
    folder = _saved(tmp_path / "qwen2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = load_tokenizer(str(folder))
    assert tok(PROBE, add_special_tokens=False)["input_ids"] == _file_ids(folder, PROBE)
    text = random_text(60, seed=4)
    assert tok(text, add_special_tokens=False)["input_ids"] == _file_ids(folder, text)
    assert 0 not in _file_ids(folder, text)   # the text's words are all in the vocabulary


def test_a_hub_snapshot_is_the_folder_of_its_tokenizer(tmp_path, local_hub):
    snapshot = local_hub("org/tiny", _saved(tmp_path / "src"))
    assert tokenizer_folder("org/tiny") == snapshot
    assert tokenizer_folder(tmp_path / "src") == tmp_path / "src"
    assert tokenizer_folder("org/not-cached") is None


def test_outputs_carry_the_source_tokenizer_files_byte_for_byte(tmp_path):
    """prune and export write the source's tokenizer files as they were (a class's save_pretrained would
    write its own rebuild: another tokenizer.json and tokenizer_class); chat templates and extra files too."""
    src = _saved(tmp_path / "src")
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "calib.txt").write_text(random_text(3000, seed=1))
    out, exported = tmp_path / "pruned", tmp_path / "exported"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shuffleprune.prune(str(src), "fast", out, calib=str(tmp_path / "calib.txt"), eval_text=None, nsamples=4,
                           seqlen=32, progress=False)
        shuffleprune.export(out, exported, progress=False)
    files = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "additional_chat_templates/tool_use.jinja"]
    for folder in (out, exported):
        for name in files:
            assert (folder / name).read_bytes() == (src / name).read_bytes(), (folder, name)
    assert AutoTokenizer.from_pretrained(exported).chat_template == {
        "default": (src / "chat_template.jinja").read_text(),
        "tool_use": (src / "additional_chat_templates" / "tool_use.jinja").read_text()}


def test_a_tokenizer_built_in_memory_is_saved_by_its_class(tmp_path):
    tok = make_tokenizer()
    save_tokenizer(tok, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    text = random_text(30, seed=5)
    assert _file_ids(tmp_path, text) == tok(text, add_special_tokens=False)["input_ids"]


def test_the_command_line_says_so_in_one_line_and_writes_the_files(tmp_path):
    from typer.testing import CliRunner

    from shuffleprune.cli import app

    src = _saved(tmp_path / "src")
    (tmp_path / "calib.txt").write_text(random_text(3000, seed=1))
    r = CliRunner().invoke(app, ["prune", str(src), "--recipe", "fast", "--calib", str(tmp_path / "calib.txt"),
                                 "--nsamples", "4", "--seqlen", "32", "--eval-text", str(tmp_path / "calib.txt"),
                                 "--eval-ctx", "32", "--eval-tokens", "256", "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    said = [line for line in r.output.splitlines() if "encodes text otherwise than its tokenizer.json" in line]
    assert len(said) == 1 and said[0].startswith("warning: the tokenizer of ") and "Warning" not in r.output, r.output
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_a_tokenizer_json_this_tokenizers_cannot_read_leaves_the_class_alone(tmp_path):
    make_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "9.0", "model": {"type": "FromTheFuture"}}')
    rebuilt = _space_stripping()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert as_its_file(rebuilt, tmp_path, "ckpt") is rebuilt


def test_a_dst_model_carries_its_tokenizer_files_byte_for_byte(tmp_path):
    from shuffleprune.dst import DSTConfig
    from shuffleprune.dst.config import TrainConfig
    from shuffleprune.dst.train import train

    src = _saved(tmp_path / "src")
    (tmp_path / "text.txt").write_text(random_text(4000, seed=1))
    cfg = TrainConfig(arch="gpt2", config_kw={"n_layer": 1, "n_embd": 32, "n_head": 2}, tokenizer=str(src),
                      data=str(tmp_path / "text.txt"), seq_len=16, batch_size=2, steps=2, warmup=1, eval_every=2,
                      eval_tokens=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg, DSTConfig(method="dense"), tmp_path / "run", progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "run" / "model" / name).read_bytes() == (src / name).read_bytes(), name


def test_a_loaded_tokenizer_changed_after_loading_is_saved_with_its_changes(tmp_path):
    """Copying the files would drop what a caller added since (a token, a chat template): such a tokenizer is
    written by its save_pretrained, an unchanged one as its files."""
    src = _saved(tmp_path / "src", "llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unchanged, changed = load_tokenizer(str(src)), load_tokenizer(str(src))
    save_tokenizer(unchanged, tmp_path / "a")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    changed.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    changed.chat_template = "{{ messages[0]['content'] }}"
    save_tokenizer(changed, tmp_path / "b")
    again = AutoTokenizer.from_pretrained(tmp_path / "b")
    assert "<tool>" in again.get_vocab() and again.chat_template == changed.chat_template


def _tekken_only(folder: Path) -> Path:
    """A Mistral checkpoint's tokenizer in Mistral's own format only: ``tekken.json`` (byte-level BPE ranks,
    base64) and three special tokens, beside a ``mistral`` config."""
    import base64
    import json

    from transformers import MistralConfig

    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the", b"in", b"ing"]
    specials = [{"rank": r, "token_str": s, "is_control": True} for r, s in enumerate(("<unk>", "<s>", "</s>"))]
    folder.mkdir()
    (folder / "tekken.json").write_text(json.dumps({
        "config": {"pattern": r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
                   "num_vocab_tokens": len(ranks), "default_vocab_size": len(ranks) + 3,
                   "default_num_special_tokens": 3, "version": "v7"},
        "vocab": [{"rank": i, "token_bytes": base64.b64encode(b).decode(), "token_str": None} for i, b in enumerate(ranks)],
        "special_tokens": specials}))
    MistralConfig(vocab_size=len(ranks) + 3, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1).save_pretrained(folder)
    return folder


def test_a_tokenizer_in_mistrals_tekken_format_alone_is_loaded_and_carried(tmp_path):
    """A folder whose only tokenizer file is ``tekken.json`` is a tokenizer (transformers 5 converts it), not a
    folder without one; outputs carry that file byte for byte."""
    src = _tekken_only(tmp_path / "src")
    tok = load_tokenizer(str(src))
    # ids after the 3 specials: "in" 262, " the" 261, " " 35 (byte 32), "th" 259, "ing" 263
    assert tok("in the thing", add_special_tokens=False)["input_ids"] == [262, 261, 35, 259, 263]
    save_tokenizer(tok, tmp_path / "out")
    assert (tmp_path / "out" / "tekken.json").read_bytes() == (src / "tekken.json").read_bytes()
    again = load_tokenizer(str(tmp_path / "out"))
    assert again("in the thing", add_special_tokens=False)["input_ids"] == [262, 261, 35, 259, 263]


def test_a_cached_hub_tokenizer_in_tekken_format_alone_is_found_offline(tmp_path, local_hub):
    """Offline, a hub id was taken for uncached unless its cache held tokenizer_config.json or tokenizer.json:
    a repo whose tokenizer is ``tekken.json`` alone was refused though it was there. A cached repo without
    any tokenizer file is still refused with the fix."""
    from shuffleprune.errors import UserError
    from shuffleprune.models import check_tokenizer_spec

    snapshot = local_hub("mistral-like/tekken-only", _tekken_only(tmp_path / "src"))
    check_tokenizer_spec("mistral-like/tekken-only")
    assert tokenizer_folder("mistral-like/tekken-only") == snapshot
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    local_hub("someone/no-tokenizer", bare)
    with pytest.raises(UserError, match="cannot load tokenizer 'someone/no-tokenizer': .*no copy of it in the local cache"):
        check_tokenizer_spec("someone/no-tokenizer")


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_that_is_not_json_is_named_as_the_tokenizers(tiny_dir, tmp_path, broken):
    """A tokenizer .json file cut short or overwritten was reported as "cannot load model …: Expecting property
    name …", pointing at the model; the error now says it is the tokenizer's files and what to do."""
    import shutil

    from shuffleprune.errors import UserError
    from shuffleprune.models import load_model

    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    (folder / broken).write_text("{garbage")
    with pytest.raises(UserError, match=rf"^cannot load the tokenizer of '{folder}': one of its .json files is not "
                                        r"valid JSON \(Expecting property name.*\); copy or download its tokenizer files"):
        load_model(str(folder))
