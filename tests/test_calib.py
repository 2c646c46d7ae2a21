import json

import pytest
import torch

from conftest import make_tokenizer, random_text
from shuffleprune.calib import calibration_windows, default_eval_source, eval_tokens, get_source
from shuffleprune.calib.sources import strip_brown_tags
from shuffleprune.errors import UserError


def test_windows_are_seeded_and_come_from_the_text(text_file):
    tok = make_tokenizer()
    src = get_source(str(text_file))
    a = calibration_windows(src, tok, 5, 16, seed=3)
    assert a.shape == (5, 16)
    assert torch.equal(a, calibration_windows(src, tok, 5, 16, seed=3))
    assert not torch.equal(a, calibration_windows(src, tok, 5, 16, seed=4))
    stream = torch.tensor(tok("\n\n".join(src.documents("train")), add_special_tokens=False)["input_ids"])
    for row in a:  # every window is a contiguous slice of the train stream
        starts = (stream.unfold(0, 16, 1) == row).all(1)
        assert starts.any()


def test_train_and_test_splits_are_disjoint(tmp_path):
    path = tmp_path / "docs.jsonl"
    docs = [f"document number {i} " + random_text(20, i) for i in range(30)]
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    src = get_source(str(path))
    train, test = src.documents("train"), src.documents("test")
    assert len(test) == 3 and len(train) == 27 and not set(train) & set(test)
    assert eval_tokens(src, make_tokenizer(), max_tokens=10).shape == (1, 10)


def test_bad_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: .*'text' field"):
        get_source(str(path)).documents("train")


def test_unknown_source_and_defaults():
    with pytest.raises(UserError, match="unknown text source"):
        get_source("c5")
    assert default_eval_source("wiki") == "brown" and default_eval_source("brown") == "wiki"
    assert default_eval_source("c4") == "wikitext2"


def test_c4_without_hub_names_the_offline_sources():
    with pytest.raises(UserError) as exc:
        get_source("c4").documents("train")
    msg = str(exc.value)
    assert "--calib wiki" in msg and "--calib brown" in msg and "\n" not in msg


def test_brown_tags_are_stripped():
    raw = "\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, Friday/nr ./.\n\n\tIt/pps ran/vbd ./.\n"
    assert strip_brown_tags(raw) == 'The jury said "no evidence", Friday.\nIt ran.'
