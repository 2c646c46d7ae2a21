"""``eval``'s paired differences: each item's score kept, every model compared item by item with a baseline."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import make_tokenizer, tiny_model
from shuffleprune.cli import app
from shuffleprune.errors import UserError
from shuffleprune.evaluation.config import EvalConfig
from shuffleprune.evaluation.evaluate import evaluate_models
from shuffleprune.evaluation.lm_eval_tasks import headline_metric, metric_table, stderr_name
from shuffleprune.evaluation.paired import (add_paired, average_difference, item_scores, paired_difference,
                                            repeated_difference)

runner = CliRunner()
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_item_scores_are_in_doc_order_of_one_filter_and_only_right_or_wrong():
    samples = [{"doc_id": 2, "filter": "none", "acc": 1.0}, {"doc_id": 0, "filter": "none", "acc": 0.0},
               {"doc_id": 1, "filter": "none", "acc": True}, {"doc_id": 0, "filter": "strict", "acc": 1.0}]
    assert item_scores(samples, "acc") == "011"
    # another filter's metric is named as lm-eval names it, and read from that filter's samples only
    two = [{"doc_id": 0, "filter": "strict", "exact_match": 1}, {"doc_id": 0, "filter": "flexible", "exact_match": 0}]
    assert item_scores(two, "exact_match,strict") == "1" and item_scores(two, "exact_match,flexible") == "0"
    assert item_scores([{"doc_id": 0, "filter": "none", "f1": 0.5}], "f1") is None        # not right/wrong
    assert item_scores([{"doc_id": 0, "filter": "none", "ppl": (1.0, 2)}], "ppl") is None  # a tuple per item
    assert item_scores([], "acc") is None
    import numpy as np

    assert item_scores([{"doc_id": 0, "filter": "none", "acc": np.bool_(True)},
                        {"doc_id": 1, "filter": "none", "acc": np.float64(0.0)}], "acc") == "10"


def test_each_filters_metrics_stay_apart():
    # gsm8k-like results: one metric under two filters (before, the second overwrote the first, unnamed)
    raw = {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1,
           "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": 0.2, "alias": "gsm8k"}
    metrics = metric_table(raw)
    assert metrics == {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1,
                       "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": 0.2}
    headline = headline_metric("gsm8k", metrics)
    assert headline == "exact_match,strict-match" and metrics[stderr_name(headline)] == 0.1
    assert metric_table({"acc,none": 0.5, "acc_stderr,none": float("nan")}) == {"acc": 0.5, "acc_stderr": None}
    assert stderr_name("acc") == "acc_stderr"


def test_the_paired_error_is_the_standard_error_of_the_per_item_differences():
    model, base = "1101100111", "1001010110"
    d = [int(a) - int(b) for a, b in zip(model, base)]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)) / math.sqrt(len(d))
    got = paired_difference(model, base)
    assert got["diff"] == pytest.approx(0.2) and got["stderr"] == pytest.approx(se)
    assert (got["n"], got["only_model"], got["only_baseline"]) == (10, 3, 1)
    # far below the two accuracies' own errors combined: what pairing buys
    p, q = model.count("1") / 10, base.count("1") / 10
    assert got["stderr"] < math.sqrt(p * (1 - p) / 9 + q * (1 - q) / 9)
    assert paired_difference("11", "111") is None   # not the same items
    assert paired_difference("1", "0")["stderr"] is None
    avg = average_difference({"a": {"diff": 0.1, "stderr": 0.03}, "b": {"diff": -0.3, "stderr": 0.04}})
    assert avg["diff"] == pytest.approx(-0.1) and avg["stderr"] == pytest.approx(0.025)
    assert average_difference({"a": {"diff": 0.1, "stderr": 0.03}, "b": None}) is None


def test_a_repeated_comparison_averages_each_items_difference_over_the_repeats():
    one = [("1101100111", "1001010110")]
    assert {k: v for k, v in repeated_difference(one).items() if k != "repeats"} == \
        {k: v for k, v in paired_difference(*one[0]).items() if k in ("diff", "stderr", "n")}
    two = one + [("0101100111", "1001110111")]
    d = [((int(a) - int(b)) + (int(c) - int(e))) / 2 for a, b, c, e in zip(*two[0], *two[1])]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
    got = repeated_difference(two)
    assert got["repeats"] == 2 and got["n"] == 10
    assert got["diff"] == pytest.approx(mean) and got["stderr"] == pytest.approx(se)
    # the repeats disagree on items, so the averaged differences spread less than one repeat's
    assert got["stderr"] < paired_difference(*one[0])["stderr"]
    assert repeated_difference(one + [("11", "10")]) is None   # a repeat on other items
    assert repeated_difference([]) is None


def test_add_paired_compares_every_other_row_on_the_tasks_it_shares():
    rows = [{"model": "a", "results": {"t": {"metric": "acc", "value": .5, "items": "1100"},
                                       "u": {"metric": "acc", "value": .5, "items": "10"}}},
            {"model": "b", "results": {"t": {"metric": "acc", "value": .75, "items": "1110"},
                                       "u": {"metric": "acc", "value": .5, "items": "01"}}},
            {"model": "c", "results": {"t": {"metric": "acc", "value": .25, "items": None}}}]
    add_paired(rows, baseline=0)
    assert "vs_baseline" not in rows[0]
    b = rows[1]["vs_baseline"]
    assert b["baseline"] == "a" and b["tasks"]["t"]["diff"] == pytest.approx(0.25) and b["tasks"]["u"]["diff"] == 0
    assert b["average"]["diff"] == pytest.approx(0.125)
    assert rows[2]["vs_baseline"]["tasks"] == {"t": None} and rows[2]["vs_baseline"]["average"] is None


@pytest.fixture
def two_models(tmp_path):
    """Two tiny LLaMAs with different weights (so they answer some items differently)."""
    paths = []
    for seed in (0, 7):
        path = tmp_path / f"llama-{seed}"
        tiny_model("llama", seed=seed).save_pretrained(path)
        make_tokenizer().save_pretrained(path)
        paths.append(path)
    return paths


def test_eval_keeps_each_items_score_and_the_paired_difference_from_the_baseline(two_models, tiny_task, tmp_path):
    a, b = (str(p) for p in two_models)
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["eval", a, b, "--tasks", "tiny_mc", "--include-path", str(tiny_task), "--out", str(out),
                              "--quiet"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    first, second = data["models"]
    ia, ib = first["results"]["tiny_mc"]["items"], second["results"]["tiny_mc"]["items"]
    assert len(ia) == len(ib) == 16 and set(ia + ib) <= {"0", "1"}
    assert ia.count("1") / 16 == pytest.approx(first["results"]["tiny_mc"]["value"])   # the items lm-eval scored
    assert ia != ib, "the two models answer alike: the test shows nothing"
    assert data["baseline"] == "llama-0" and "vs_baseline" not in first
    paired = second["vs_baseline"]
    assert paired["baseline"] == "llama-0" and paired["tasks"]["tiny_mc"] == paired_difference(ib, ia)
    assert paired["tasks"]["tiny_mc"]["diff"] == pytest.approx(second["average"] - first["average"])
    assert paired["average"]["diff"] == pytest.approx(second["average"] - first["average"])
    d = paired["tasks"]["tiny_mc"]
    shown = f"{100 * d['diff']:+.2f} ± {100 * d['stderr']:.2f}"
    assert "Δ average vs llama-0" in " ".join(res.output.split()) and shown in res.output
    md = out.with_suffix(".md").read_text()
    assert f"| tiny_mc | {shown} ({d['only_model']}/{d['only_baseline']}) |" in md

    # --baseline names the model the others are compared with (the same folder however spelled)
    res = runner.invoke(app, ["eval", a, b, "--tasks", "tiny_mc", "--include-path", str(tiny_task), "--quiet",
                              "--baseline", b + "/", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["baseline"] == "llama-7" and "vs_baseline" not in data["models"][1]
    assert data["models"][0]["vs_baseline"]["tasks"]["tiny_mc"]["diff"] == pytest.approx(-d["diff"])


def test_a_baseline_that_is_not_scored_is_refused_before_any_model_is(two_models, tiny_task, tmp_path, monkeypatch):
    a, b = (str(p) for p in two_models)
    import shuffleprune.evaluation.evaluate as ev

    monkeypatch.setattr(ev, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["eval", a, b, "--tasks", "tiny_mc", "--include-path", str(tiny_task), "--quiet",
                              "--baseline", "default", "--out", str(out)])
    assert res.exit_code == 2 and "--baseline 'default' is not one of the models to score" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not out.exists()
    with pytest.raises(UserError, match="no model's position"):
        evaluate_models(EvalConfig(models=[a, b], tasks=["tiny_mc"], include_path=[str(tiny_task)], baseline=2))


@pytest.fixture
def group_tasks(tmp_path):
    """Two lm-eval groups of two multiple-choice tasks of unequal sizes: ``by_items`` weighs its tasks by
    their sizes (lm-eval's weight_by_size, as mmlu), ``by_tasks`` weighs them alike."""
    import random

    from conftest import WORDS

    task_dir = tmp_path / "group_tasks"
    task_dir.mkdir()
    rng = random.Random(1)
    for task, size in (("mc_a", 16), ("mc_b", 9), ("mc_c", 16), ("mc_d", 9)):
        data = task_dir / f"{task}.jsonl"
        data.write_text("".join(json.dumps({"question": " ".join(rng.choice(WORDS) for _ in range(6)),
                                            "choices": [rng.choice(WORDS) for _ in range(3)],
                                            "gold": rng.randrange(3)}) + "\n" for _ in range(size)))
        (task_dir / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            "output_type: multiple_choice\ntest_split: test\ndoc_to_text: \"{{question}}\"\n"
            "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\n"
            "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n")
    for group, tasks, by_size in (("by_items", "mc_a, mc_b", "true"), ("by_tasks", "mc_c, mc_d", "false")):
        (task_dir / f"{group}.yaml").write_text(
            f"group: {group}\ntask: [{tasks}]\naggregate_metric_list:\n  - metric: acc\n    aggregation: mean\n"
            f"    weight_by_size: {by_size}\nmetadata:\n  version: 1.0\n")
    return task_dir


def test_a_group_is_one_row_of_its_aggregate_with_its_tasks_under_it(two_models, group_tasks, tmp_path):
    a, b = (str(p) for p in two_models)
    res = evaluate_models(EvalConfig(models=[a, b], tasks=["by_items", "by_tasks"], include_path=[str(group_tasks)]),
                          progress=False)
    first, second = res["models"]
    # the rows are the groups asked for; the average is theirs (before, every task and group was a row of it)
    assert list(first["results"]) == ["by_items", "by_tasks"]
    assert first["average"] == pytest.approx((first["results"]["by_items"]["value"] +
                                              first["results"]["by_tasks"]["value"]) / 2)
    by_items, by_tasks = first["results"]["by_items"], first["results"]["by_tasks"]
    assert list(by_items["subtasks"]) == ["mc_a", "mc_b"] and by_items["n_items"] == 25
    assert by_items["aggregate"] == "mean of items" and by_tasks["aggregate"] == "mean of subtasks"
    assert by_items["items"] == by_items["subtasks"]["mc_a"]["items"] + by_items["subtasks"]["mc_b"]["items"]
    assert by_items["items"].count("1") / 25 == pytest.approx(by_items["value"]) and by_tasks["items"] is None
    paired = second["vs_baseline"]["tasks"]
    assert paired["by_items"] == paired_difference(second["results"]["by_items"]["items"], by_items["items"])
    subs = [paired_difference(second["results"]["by_tasks"]["subtasks"][t]["items"], by_tasks["subtasks"][t]["items"])
            for t in ("mc_c", "mc_d")]
    assert paired["by_tasks"]["diff"] == pytest.approx((subs[0]["diff"] + subs[1]["diff"]) / 2)
    assert paired["by_tasks"]["diff"] == pytest.approx(second["results"]["by_tasks"]["value"] - by_tasks["value"])
    assert paired["by_tasks"]["stderr"] == pytest.approx(math.hypot(subs[0]["stderr"], subs[1]["stderr"]) / 2)
    assert second["vs_baseline"]["average"]["diff"] == pytest.approx(second["average"] - first["average"])


def test_paired_over_seeds_script_pools_the_runs_of_several_results_files(tmp_path):
    spec = importlib.util.spec_from_file_location("paired_over_seeds", SCRIPTS / "paired_over_seeds.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    pairs = [("1101100111", "1001010110"), ("0101100111", "1001110111")]
    files = []
    for seed, (items, base) in enumerate(pairs):
        rows = [{"model": "base", "ppl": 20.0, "average": 0.5,
                 "results": {"t": {"metric": "acc", "value": base.count("1") / 10, "items": base}}},
                {"model": f"ours_s{seed}", "ppl": 10.0, "average": 0.6,
                 "fitted_on": {"calibration": {"seed": seed}},
                 "results": {"t": {"metric": "acc", "value": items.count("1") / 10, "items": items}}}]
        add_paired(rows, baseline=0)
        f = tmp_path / f"eval_s{seed}.json"
        f.write_text(json.dumps({"models": rows, "baseline": "base", "config": {"limit": None}}))
        files.append(f"{f}:ours_s{seed}")
    out = tmp_path / "pooled.json"
    script.main(["--run", files[0], "--run", files[1], "--label", "ours", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["pooled"]["tasks"]["t"] == repeated_difference(pairs)
    assert got["pooled"]["average"]["diff"] == pytest.approx(repeated_difference(pairs)["diff"])
    assert [r["vs_baseline"]["tasks"]["t"] for r in got["runs"]] == [paired_difference(*p) for p in pairs]
    assert "| t | +20.00 ± " in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit, match="no model 'nobody'"):
        script.main(["--run", files[0].rsplit(":", 1)[0] + ":nobody"])
