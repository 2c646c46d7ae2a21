import json
import re
from pathlib import Path

import pytest
import torch

from conftest import fake_hub_datasets, make_tokenizer, random_text
from shuffleprune.calib import bos_token, calibration_windows, default_eval_source, eval_tokens, get_source, same_text
from shuffleprune.calib.documents import documents_of_rows
from shuffleprune.calib.corpora import strip_brown_tags
from shuffleprune.calib.sources import held_out_part, text_contains
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


def test_a_file_is_used_whole_and_split_only_when_it_serves_both_sides(tmp_path):
    path = tmp_path / "docs.jsonl"
    docs = [f"document number {i} " + random_text(20, i) for i in range(30)]
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs))
    whole = get_source(str(path))
    assert whole.documents("train") == docs and whole.documents("test") == docs
    shared = get_source(str(path), shared=True)
    train, test = shared.documents("train"), shared.documents("test")
    assert len(test) == 3 and len(train) == 27 and not set(train) & set(test)
    assert shared.documents("test") == test  # deterministic
    info = {}
    assert eval_tokens(shared, make_tokenizer(), max_tokens=10, info=info).shape == (1, 10)
    assert info["documents"] == 3 and info["tokens_available"] > 10
    assert same_text(str(path), str(tmp_path / "." / "docs.jsonl")) and not same_text(str(path), "wiki")
    two = tmp_path / "two.txt"
    two.write_text("first document\n\nsecond document")
    assert get_source(str(two), shared=True).documents("test") == ["second document"]


def test_windows_start_with_bos_where_the_tokenizer_adds_it():
    from tokenizers import processors

    tok = make_tokenizer()
    assert bos_token(tok) is None
    bos_tok = make_tokenizer()
    bos_tok.add_special_tokens({"bos_token": "[BOS]"})
    bos_id = bos_tok.bos_token_id
    bos_tok._tokenizer.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", bos_id)])
    assert bos_token(bos_tok) == bos_id
    text = random_text(400, 1)
    from shuffleprune.calib.sources import TextSource

    src = TextSource("t", lambda split: [text])
    w = calibration_windows(src, bos_tok, 4, 16, seed=0, bos=bos_id)
    assert w.shape == (4, 16) and (w[:, 0] == bos_id).all() and not (w[:, 1:] == bos_id).any()
    # --bos text: the text encoded as the tokenizer encodes it alone (BOS at its start only) and windows
    # cut from it as SparseGPT's and Wanda's loaders cut them
    import random

    stream, rng = bos_tok(text)["input_ids"], random.Random(0)
    papers = []
    for _ in range(4):
        start = rng.randint(0, len(stream) - 16 - 1)
        papers.append(stream[start:start + 16])
    assert calibration_windows(src, bos_tok, 4, 16, seed=0, special_tokens=True).tolist() == papers
    assert eval_tokens(src, bos_tok, special_tokens=True)[0].tolist() == stream
    # the shortest window: two tokens of text, after the BOS where one starts each window; each bad size named alone
    assert calibration_windows(src, bos_tok, 2, 3, seed=0, bos=bos_id).shape == (2, 3)
    assert calibration_windows(src, tok, 2, 2, seed=0).shape == (2, 2)
    with pytest.raises(UserError, match=r"^--seqlen must be >= 3 \(the model's BOS token and two tokens of text\), got 2$"):
        calibration_windows(src, bos_tok, 2, 2, seed=0, bos=bos_id)
    with pytest.raises(UserError, match=r"^--nsamples must be >= 1, got 0$"):
        calibration_windows(src, tok, 0, 16, seed=0)


def test_bad_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    for text, needle in (('{"text": "ok"}\n{"body": "no text field"}\n', r"bad.jsonl:2: no 'text' text field"),
                         ('{"text": "ok"}\n{"text": "ok", \n', r"bad.jsonl:2: not a JSON object"),
                         ('["a list"]\n', r"bad.jsonl:1: each .jsonl line must be a JSON object"),
                         ('{"question": "q", "answer": "a"}\n', r"bad.jsonl:1: no single text field \(string fields: "
                                                                 r"question, answer\)")):
        path.write_text(text)
        with pytest.raises(UserError, match=needle):
            get_source(str(path)).documents("train")


def test_a_local_file_is_parsed_when_named_and_its_faults_found_then(tmp_path, monkeypatch):
    """Naming a file checks all of it (a bad line deep in a .jsonl fails before any model loads, and
    one file of one document for both sides); using the source reads it no more (it was read at
    every documents() call)."""
    import shuffleprune.calib.files as files

    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(20)) + '\n{"text": 3}\n')
    with pytest.raises(UserError, match=r"docs.jsonl:21: no 'text' text field"):
        get_source(str(path))   # no .documents(): the fault is found when the source is named
    path.write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(20)))
    reads = []
    real = files.read_text_file
    monkeypatch.setattr(files, "read_text_file", lambda p: reads.append(p) or real(p))
    src = get_source(str(path), shared=True)
    for _ in range(3):
        assert src.documents("test") == ["doc 9", "doc 19"] and len(src.documents("train")) == 18
    assert len(reads) == 1
    lines = [f"sentence {i} of the only document" for i in range(20)]
    path.write_text(json.dumps({"text": "\n".join(lines)}))   # one document (one line per sentence): its last tenth
    src = get_source(str(path), shared=True)                  # held out (it was an error)
    (head,), (tail,) = src.documents("train"), src.documents("test")
    assert head + tail == "\n".join(lines) and tail.startswith("\nsentence 19") and len(tail) <= len(head) // 9
    path.write_text(json.dumps({"text": "x"}))
    with pytest.raises(UserError, match=r"'.*docs.jsonl' is too short to split into text to fit on and held-out text"):
        get_source(str(path), shared=True)   # the split's fault at naming time
    path.write_text("\n\n")
    with pytest.raises(UserError, match=r"'.*docs.jsonl' holds no text"):
        get_source(str(path))
    (tmp_path / "folder.txt").mkdir()
    with pytest.raises(UserError, match=r"text file '.*folder.txt' is a directory; give a .txt, .jsonl, .json, .csv, .tsv or .parquet file"):
        get_source(str(tmp_path / "folder.txt"))   # was "does not exist"


def test_a_directory_is_the_documents_of_its_text_files(tmp_path, monkeypatch):
    """``--calib DIR`` reads every .txt and .jsonl file under it in path order (hidden ones left out;
    a directory was an unknown source); named for both sides it is split as one file is."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / ".cache").mkdir()
    (corpus / "b.txt").write_text("doc b1\n\ndoc b2")
    (corpus / "a.jsonl").write_text(json.dumps({"text": "doc a1"}) + "\n" + json.dumps({"text": "doc a2"}))
    (corpus / "sub" / "c.txt").write_text("doc c1")
    (corpus / ".cache" / "d.txt").write_text("hidden")
    (corpus / "notes.md").write_text("not a text source")
    source = get_source(str(corpus))
    assert source.documents("train") == source.documents("test") == ["doc a1", "doc a2", "doc b1", "doc b2", "doc c1"]
    assert get_source(str(corpus), shared=True).documents("test") == ["doc c1"]   # fewer than ten: the last held out
    monkeypatch.chdir(tmp_path)
    assert same_text("corpus", str(corpus) + "/") and not same_text("corpus", str(corpus / "b.txt"))
    assert held_out_part("corpus") == "all of its files" and held_out_part("corpus", True) == "its held-out part"
    assert text_contains("corpus", "corpus/sub/c.txt") and text_contains("corpus", "corpus/sub")
    assert not text_contains("corpus/sub", "corpus") and not text_contains("corpus/b.txt", "corpus/sub/c.txt")


def test_text_files_are_utf8_a_byte_order_mark_dropped(tmp_path):
    """A file saved with a BOM (Windows editors) reads as without one, .jsonl too; other encodings are a
    one-line error when the source is named (before any model loads), not a UnicodeDecodeError later."""
    rows = [{"text": "first document"}, {"text": "second one"}]
    for suffix, text in ((".jsonl", "\n".join(json.dumps(r) for r in rows)), (".txt", "first document\n\nsecond one")):
        path = tmp_path / f"bom{suffix}"
        path.write_text(text, encoding="utf-8-sig")
        assert get_source(str(path)).documents("train") == ["first document", "second one"]
    path = tmp_path / "latin.txt"
    path.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(UserError, match=r"'.*latin.txt' is not UTF-8 text \(byte 0xe9 at offset 3\); convert it"):
        get_source(str(path))
    path = tmp_path / "latin.csv"   # read by pyarrow, which names no byte
    path.write_bytes("text\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"'.*latin.csv' is not UTF-8 text \(.*invalid UTF8 data\); convert it first"):
        get_source(str(path))


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "utf-32-be"])
def test_text_files_with_a_utf16_or_utf32_byte_order_mark_are_read_in_that_encoding(tmp_path, encoding):
    """Windows editors save "Unicode" text as UTF-16 with a byte-order mark; such a file was refused as not
    UTF-8 with a latin-1 conversion to run, which would have turned it into noise. A mark says the encoding:
    the text reads as its UTF-8 copy does (.txt, .csv and gzip-compressed .jsonl alike); a file whose bytes
    break the encoding its mark names is still a one-line error."""
    import gzip

    cases = {"t.txt": "café au lait, 東京\n\nsecond document", "t.csv": "text,id\ncafé au lait,1\n東京,2\n",
             "t.jsonl.gz": json.dumps({"text": "café au lait"}) + "\n" + json.dumps({"text": "東京"})}
    for name, text in cases.items():
        ours, theirs = tmp_path / name, tmp_path / ("utf8-" + name)
        data = ("\ufeff" if encoding.endswith("-be") else "") + text   # the plain codecs write a mark themselves
        raw, plain = data.encode(encoding), text.encode("utf-8")
        ours.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
        theirs.write_bytes(gzip.compress(plain) if name.endswith(".gz") else plain)
        assert get_source(str(ours)).documents("train") == get_source(str(theirs)).documents("train")
    bad = tmp_path / "bad.txt"
    bad.write_bytes("\ufeffcafé".encode(encoding)[:-1])   # cut inside the last character
    with pytest.raises(UserError, match=rf"^'.*bad.txt' begins with a {encoding[:6].upper()} byte-order mark but is not "
                                        rf"{encoding[:6].upper()} text \(byte 0x.. at offset \d+\): cut short\? write it "
                                        "again, as UTF-8$"):
        get_source(str(bad))


def test_jsonl_text_is_read_from_the_field_a_hub_dataset_would_use(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"id": 1, "content": "first document", "url": "u"}, {"id": 2, "content": "second one", "url": "v"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert get_source(str(path)).documents("train") == ["first document", "second one"]
    path.write_text('{"id": 1, "prose": "only string field"}\n')  # no usual name: the one string field
    assert get_source(str(path)).documents("train") == ["only string field"]


def test_unknown_source_and_defaults():
    with pytest.raises(UserError, match="unknown text source"):
        get_source("c5")
    assert default_eval_source("wiki") == "brown" and default_eval_source("brown") == "wiki"
    assert default_eval_source("c4") == "wikitext2"


def test_c4_without_hub_names_the_offline_sources():
    with pytest.raises(UserError) as exc:
        get_source("c4").documents("train")
    msg = str(exc.value)
    assert "offline sources: wiki, brown or a .txt, .jsonl, .json, .csv, .tsv or .parquet file (for --calib, --eval-text, --ppl-text or --data)" in msg
    assert "\n" not in msg


def test_c4_perplexity_reads_what_sparsegpt_and_wanda_score(monkeypatch):
    """c4's held-out text is the first 1100 documents of validation shard 0, joined with spaces,
    scored on at most 256 windows of the context, as the papers' loaders do (it was the whole shard
    and so other numbers than theirs)."""
    import datasets

    import shuffleprune.hub

    asked = []

    def load_dataset(repo, data_files=None, split=None):
        asked.append((repo, data_files, split))
        return datasets.Dataset.from_dict({"text": [random_text(30, i) for i in range(1500)]})

    monkeypatch.setattr(shuffleprune.hub, "hub_reachable", lambda *a, **k: True)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    source = get_source("c4")
    docs = source.documents("test")
    assert asked == [("allenai/c4", {"test": "en/c4-validation.00000-of-00008.json.gz"}, "test")]
    assert docs == [random_text(30, i) for i in range(1100)]
    tokenizer = make_tokenizer()
    whole = tokenizer(" ".join(docs), add_special_tokens=False)["input_ids"]
    assert eval_tokens(source, tokenizer, ctx=16)[0].tolist() == whole[:256 * 16]
    assert eval_tokens(source, tokenizer, 100, ctx=16).numel() == 100   # a smaller --eval-tokens still wins
    assert len(source.documents("train")) == 1500   # calibration reads the train shard whole
    assert held_out_part("c4") == "validation split" and held_out_part("wikitext2") == "test split"


def test_wikitext2_is_joined_as_the_papers_join_it(monkeypatch):
    """WikiText-2 calibration windows come from the train lines joined with spaces, its perplexity
    from the test lines joined with blank lines, as SparseGPT's and Wanda's loaders build them (both
    were joined with blank lines)."""
    import datasets

    import shuffleprune.calib.sampling as sampling
    import shuffleprune.hub

    lines = {"train": [random_text(12, i) + "\n" for i in range(60)], "test": [random_text(12, 100 + i) for i in range(9)]}
    asked = []

    def load_dataset(repo, config=None, split=None):
        asked.append((repo, config, split))
        return datasets.Dataset.from_dict({"text": lines[split]})

    monkeypatch.setattr(shuffleprune.hub, "hub_reachable", lambda *a, **k: True)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    encoded, encode = [], sampling.encode
    monkeypatch.setattr(sampling, "encode", lambda tokenizer, text, *rest: encoded.append(text) or encode(tokenizer, text, *rest))
    source = get_source("wikitext2")
    calibration_windows(source, make_tokenizer(), nsamples=3, seqlen=16, seed=5)
    eval_tokens(source, make_tokenizer())
    assert encoded == [" ".join(lines["train"]), "\n\n".join(lines["test"])]
    # the papers' `wikitext` under the id it moved to (the bare name is reported not to resolve with newer hubs)
    assert asked == [("Salesforce/wikitext", "wikitext-2-raw-v1", "train"), ("Salesforce/wikitext", "wikitext-2-raw-v1", "test")]
    asked.clear()
    get_source("wikitext103").documents("train")
    assert asked == [("Salesforce/wikitext", "wikitext-103-raw-v1", "train")]


def test_brown_tags_are_stripped():
    raw = "\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, Friday/nr ./.\n\n\tIt/pps ran/vbd ./.\n"
    assert strip_brown_tags(raw) == 'The jury said "no evidence", Friday.\nIt ran.'


def test_any_hub_dataset_with_a_text_column_is_a_source(monkeypatch):
    """``--calib OWNER/NAME[:CONFIG]`` streams that dataset: its text column (named, or its only string
    column), calibration from ``train``, held-out text from ``test`` (or ``validation``); a dataset
    with one split holds out every 10th document; held-out perplexity defaults to wikitext2."""
    train = [f"train document {i}" for i in range(25)]
    calls = fake_hub_datasets(monkeypatch, {"train": {"id": list(range(25)), "content": train},
                                             "validation": {"id": [0, 1], "content": ["held 0", "held 1"]}})
    source = get_source("me/corpus:en")
    assert source.documents("train") == train and source.documents("test") == ["held 0", "held 1"]
    assert calls == [("me/corpus", "en", "train", True), ("me/corpus", "en", "validation", True)]
    assert default_eval_source("me/corpus:en") == "wikitext2"

    fake_hub_datasets(monkeypatch, {"train": {"n": list(range(25)), "story": train}})   # the only string column
    assert get_source("me/stories").documents("test") == train[9::10]
    assert get_source("me/stories").documents("train") == [d for i, d in enumerate(train) if i % 10 != 9]

    fake_hub_datasets(monkeypatch, {"train": {"question": ["q"], "answer": ["a"]}})
    with pytest.raises(UserError, match=r"no single text field \(string fields: question, answer\) and no chat field.*\.jsonl"):
        get_source("me/qa").documents("train")


def test_chat_datasets_are_read_as_conversations_and_rendered_by_the_chat_template(tmp_path, monkeypatch):
    """A dataset of conversations (a ``messages`` column of role/content dicts, as UltraChat; ShareGPT's
    ``conversations`` of from/value) calibrates as the chat model was tuned: each conversation rendered by
    the tokenizer's chat template, or as plain ``role: content`` lines where there is none or the template
    refuses it. The hub's ``train_sft`` split pairs with ``test_sft`` for held-out text."""
    import pickle

    from conftest import make_tokenizer
    from shuffleprune.calib.documents import Conversation, rendered
    from shuffleprune.calib.sources import as_documents

    chats = [[{"role": "user", "content": f"the cat {i}"}, {"role": "assistant", "content": "a dog sat"}] for i in range(20)]
    calls = fake_hub_datasets(monkeypatch, {
        "train_sft": {"prompt": [c[0]["content"] for c in chats], "prompt_id": ["x"] * 20, "messages": chats},
        "test_sft": {"prompt": ["q"], "prompt_id": ["y"], "messages": [chats[0]]}})
    docs = get_source("me/ultrachat").documents("train")
    assert [d.messages for d in docs] == [tuple(c) for c in chats]
    assert docs[3] == "user: the cat 3\nassistant: a dog sat"   # the plain rendering
    assert get_source("me/ultrachat").documents("test") == [docs[0]] and calls[-1][2] == "test_sft"

    path = tmp_path / "sharegpt.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "conversations": [{"from": "human", "value": c[0]["content"]},
                                                                          {"from": "gpt", "value": "a dog sat"}]}) + "\n"
                            for i, c in enumerate(chats)))
    assert get_source(str(path)).documents("train") == docs
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"n": i, "url": "u", "messages": c} for i, c in enumerate(chats)]),
                   tmp_path / "chats.parquet")
    assert [d.messages for d in get_source(str(tmp_path / "chats.parquet")).documents("train")] == [d.messages for d in docs]
    (tmp_path / "chats.json").write_text(json.dumps(chats))   # one array of conversations
    assert [d.messages for d in get_source(str(tmp_path / "chats.json")).documents("train")] == [d.messages for d in docs]
    assert as_documents(chats, "calib") == tuple(docs)   # conversations passed in memory
    assert pickle.loads(pickle.dumps(docs[3])).messages == docs[3].messages

    tok = make_tokenizer()
    assert rendered(docs[:2], tok) == [str(d) for d in docs[:2]]   # no chat template: plain lines
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    assert rendered(docs[:2] + ["plain text"], tok) == ["<user> the cat 0 <assistant> a dog sat ",
                                                         "<user> the cat 1 <assistant> a dog sat ", "plain text"]
    info = {}
    calibration_windows(get_source(str(path)), tok, 2, 8, 0, info=info)
    stream = tok("\n\n".join(rendered(docs, tok)), add_special_tokens=False)["input_ids"]
    assert info["tokens"] == len(stream) != len(tok("\n\n".join(docs), add_special_tokens=False)["input_ids"])
    assert info["conversations"] == 20 and info["chat_template"] is True
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.warns(UserWarning, match="chat template refused 2 of 2 conversations"):
        assert rendered(docs[:2], tok) == [str(d) for d in docs[:2]]
    assert isinstance(Conversation(chats[0]), str)


def test_a_named_split_of_a_hub_dataset_reads_those_rows(monkeypatch):
    """``OWNER/NAME[:CONFIG]@SPLIT[START:STOP]`` (llm-compressor's ``train_sft[:512]``) reads those rows of
    that split, streamed once, on either side; the same rows for both sides hold out every 10th; rows
    are counts (a percentage or an empty range is a one-line error), and an unknown split names the
    dataset's splits. c4 and wikitext keep the papers' fixed splits."""
    from shuffleprune.calib.hub_data import hub_dataset_id, hub_dataset_name

    rows = [f"document {i}" for i in range(40)]
    calls = fake_hub_datasets(monkeypatch, {"train_sft": {"text": rows}, "test_sft": {"text": ["held"] * 3}})
    source = get_source("me/chat:en@train_sft[5:17]")
    assert source.documents("train") == rows[5:17] == source.documents("test")   # used whole, as a file
    assert calls == [("me/chat", "en", "train_sft", True)]   # one stream for both sides
    shared = get_source("me/chat:en@train_sft[:20]", shared=True)
    assert shared.documents("test") == [rows[9], rows[19]] and len(shared.documents("train")) == 18
    assert get_source("me/chat@test_sft").documents("train") == ["held"] * 3   # a whole split
    assert get_source("me/chat@train_sft[30:]").documents("train") == rows[30:]
    with pytest.raises(UserError, match=r"hub dataset 'me/chat' has no split 'validation'; its splits: train_sft, test_sft"):
        get_source("me/chat@validation").documents("train")
    with pytest.raises(UserError, match=r"'me/chat@train_sft\[50:\]' holds no text"):
        get_source("me/chat@train_sft[50:]").documents("train")
    for bad, why in (("train_sft[:10%]", "gives a percentage"), ("train_sft[9:3]", "selects no rows"),
                     ("train_sft[-5:]", "gives rows that are not counts from 0"), ("train_sft[:", "is not a split"),
                     ("", "is not a split")):
        with pytest.raises(UserError, match=f"'@{re.escape(bad)}' {why}.*e.g. .*@train_sft\\[:512\\]"):
            get_source(f"me/chat@{bad}")
    with pytest.raises(UserError, match="c4 is read with its own fixed splits.*allenai/c4:en@validation"):
        get_source("c4@validation")

    assert hub_dataset_name(hub_dataset_id("me/chat:en@train_sft[0:512]")) == "me/chat:en@train_sft[:512]"
    assert same_text("me/chat@train_sft[:20000]", "me/chat@train_sft") and not same_text("me/chat@train_sft", "me/chat")
    assert text_contains("me/chat@train_sft[:512]", "me/chat@train_sft[500:600]")
    assert not text_contains("me/chat@train_sft[:512]", "me/chat@train_sft[512:]")
    assert not text_contains("me/chat@train_sft[:512]", "me/chat:en@train_sft[:512]")   # another config
    assert held_out_part("me/chat@test_sft[:200]") == "test_sft split, rows 0:200"
    assert held_out_part("me/chat@train_sft[:200]", split_from_shared=True) == "its held-out part"


def test_a_dataset_directory_on_this_machine_reads_the_split_named(tmp_path, monkeypatch):
    """A dataset downloaded from the hub (``data/SPLIT-00000-of-00001.parquet`` …) given as ``DIR@SPLIT[rows]``
    is read by ``datasets`` as the hub dataset would be, without the hub, one split's rows alone; given as
    ``DIR``, its splits' files are all read as one text (as any directory), with a warning naming the fix."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import shuffleprune.hub
    from shuffleprune.calib.sources import is_local_source

    monkeypatch.setattr(shuffleprune.hub, "hub_reachable", lambda *a, **k: pytest.fail("the hub was asked"))
    (tmp_path / "snap" / "data").mkdir(parents=True)
    for split, n in (("train_sft", 30), ("test_sft", 5)):
        rows = [{"prompt_id": str(i), "messages": [{"role": "user", "content": f"{split} {i}"},
                                                   {"role": "assistant", "content": "yes"}]} for i in range(n)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "snap" / "data" / f"{split}-00000-of-00001.parquet")
    snap = str(tmp_path / "snap")
    docs = get_source(f"{snap}@test_sft[1:4]").documents("train")
    assert [d.messages[0]["content"] for d in docs] == ["test_sft 1", "test_sft 2", "test_sft 3"]
    assert len(get_source(f"{snap}@train_sft").documents("test")) == 30
    assert is_local_source(f"{snap}@train_sft") and default_eval_source(f"{snap}@train_sft") == "wiki"
    assert same_text(f"{snap}@train_sft[:10]", f"{tmp_path}/../{tmp_path.name}/snap@train_sft[0:10]")
    with pytest.raises(UserError, match=f"dataset directory '{re.escape(snap)}' has no split 'train'; its splits: "
                                        "test_sft, train_sft"):
        get_source(f"{snap}@train")
    with pytest.warns(UserWarning, match=r"several dataset splits \(test_sft, train_sft\), all read as one text; "
                                         r"to read one, give .*snap@SPLIT, e.g. @train_sft"):
        assert len(get_source(snap).documents("train")) == 35
    (tmp_path / "jsonl").mkdir()   # a split a file: train.jsonl, test.jsonl
    for split, n in (("train", 12), ("test", 2)):
        (tmp_path / "jsonl" / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"{split} {i}"}) + "\n" for i in range(n)))
    assert get_source(f"{tmp_path / 'jsonl'}@test").documents("train") == ["test 0", "test 1"]
    with pytest.warns(UserWarning, match=r"several dataset splits \(test, train\)"):
        get_source(str(tmp_path / "jsonl"))


def test_hub_dataset_ids_are_told_from_paths(tmp_path, monkeypatch):
    from shuffleprune.calib.hub_data import HubDataset, hub_dataset_id

    assert hub_dataset_id("allenai/c4") == HubDataset("allenai/c4", None, None, 0, None, local=False)
    assert hub_dataset_id("HuggingFaceFW/fineweb-edu:sample-10BT")[:2] == ("HuggingFaceFW/fineweb-edu", "sample-10BT")
    assert [hub_dataset_id(s) for s in ("./a/b", "/a/b", "~/a/b", "a/b/c", "a", "a/")] == [None] * 6
    (tmp_path / "local" / "dir").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_dataset_id("local/dir") is None
    with pytest.raises(UserError, match="directory 'local/dir' holds no .txt, .jsonl, .json, .csv, .tsv or .parquet file"):
        get_source("local/dir")   # a local directory, not a hub dataset


def test_json_csv_parquet_and_gzip_files_are_text_files(tmp_path):
    """Besides .txt and .jsonl: a .json file (JSON lines, as C4's shards, or one array), a .csv / .tsv
    file (a header, quoted cells with line breaks and delimiters, its text column), a .parquet file (its
    text column) and gzip-compressed .txt/.jsonl/.json/.csv files (a C4 shard as downloaded) give their
    documents as the .jsonl of the same documents does (they were unknown sources)."""
    import csv
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from shuffleprune.calib.files import text_file_kind

    docs = [f"document {i} with some words" for i in range(12)]
    # blank documents among them (WikiText's rows, written out as they are) are left out by every reader, as by
    # the hub's (a .jsonl kept them, so the same rows gave other windows from a file than from the hub)
    texts = docs[:2] + ["", " \n "] + docs[2:]
    rows = [{"text": d, "timestamp": "2019-04-25", "url": f"https://x/{i}"} for i, d in enumerate(texts)]
    assert documents_of_rows(rows, "rows") == docs
    lines = "\n".join(json.dumps(r) for r in rows)
    (tmp_path / "c4-train.00000-of-01024.json.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "lines.json").write_text(lines)
    (tmp_path / "array.json").write_text(json.dumps(rows))
    (tmp_path / "strings.json").write_text(json.dumps(texts))
    (tmp_path / "docs.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "docs.txt.gz").write_bytes(gzip.compress("\n\n".join(docs).encode()))
    pq.write_table(pa.table({"id": list(range(14)), "content": texts}), tmp_path / "docs.parquet")
    names = ["c4-train.00000-of-01024.json.gz", "lines.json", "array.json", "strings.json", "docs.jsonl.gz",
             "docs.txt.gz", "docs.parquet"]
    for name in names:
        source = get_source(str(tmp_path / name))
        assert source.documents("train") == docs, name
        assert get_source(str(tmp_path / name), shared=True).documents("test") == [docs[9]], name   # every 10th
        assert held_out_part(str(tmp_path / name)) == "the whole file"
    assert get_source(str(tmp_path)).documents("train") == docs * len(names)   # a directory of them
    tables = tmp_path / "tables"
    tables.mkdir()
    docs[3], docs[5] = "a document, with a comma", 'and "quotes"\nover two lines'   # what CSV quotes
    for name, delimiter in (("docs.csv", ","), ("docs.tsv", "\t")):
        with open(tables / name, "w", newline="") as f:
            table = csv.writer(f, delimiter=delimiter)
            table.writerow(["id", "text", "score"])
            table.writerows([i, d, "007"] for i, d in enumerate(docs))
    (tables / "docs.csv.gz").write_bytes(gzip.compress((tables / "docs.csv").read_bytes()))
    for name in ("docs.csv", "docs.tsv", "docs.csv.gz"):
        assert get_source(str(tables / name)).documents("train") == docs, name
    assert [text_file_kind(Path(n)) for n in ("a.b.json.gz", "a.parquet.gz", "a.gz", "a.txt", "a.csv", "a.tsv.gz", "a")] == \
        [".json", None, None, ".txt", ".csv", ".tsv", None]
    (tmp_path / "bad.json.gz").write_bytes(gzip.compress(lines.encode())[:-20])   # truncated download
    with pytest.raises(UserError, match=r"cannot read '.*bad.json.gz': .*\(a damaged or truncated gzip file\?\)$"):
        get_source(str(tmp_path / "bad.json.gz"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(UserError, match=r"cannot read '.*bad.parquet' as Parquet: "):
        get_source(str(tmp_path / "bad.parquet"))
    pq.write_table(pa.table({"a": ["x"], "b": ["y"]}), tmp_path / "two.parquet")
    with pytest.raises(UserError, match=r"'.*two.parquet': no single text field \(string fields: a, b\) and no chat field \(role/content "
                                         r"messages\); name its text field one of"):
        get_source(str(tmp_path / "two.parquet"))
    (tmp_path / "nums.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=r"nums.json:1: each .jsonl line must be a JSON object with a text field"):
        get_source(str(tmp_path / "nums.json"))
