"""A classification task of one's own (``eval.own_task``): a folder of train/validation/test CSV or
JSONL files with text (and text_pair) and label columns is a task with no other file; string
labels are mapped to indices and the mapping recorded."""

from __future__ import annotations

import csv
import json

import pytest

from megatron_ext.config_loading import UserError
from megatron_ext.eval.families import sc
from megatron_ext.eval.harness import resolve_tasks
from megatron_ext.eval.task_io import load_task


def _write_csv(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_a_folder_of_csv_files_with_string_labels_is_a_classification_task(tmp_path, news_texts):
    folder = tmp_path / "my_topics"
    folder.mkdir()
    labels = ["sport", "politics", "economy"]
    for split, texts in (("train", news_texts[:30]), ("validation", news_texts[30:40]), ("test", news_texts[40:52])):
        _write_csv(folder / f"{split}.csv", [{"text": t, "label": labels[i % 3]} for i, t in enumerate(texts)])
    suite = tmp_path / "suite"
    [ref] = resolve_tasks([str(folder)], suite_dir=suite)
    assert ref.name == "my_topics" and ref.family == "sc" and ref.metric == "accuracy"
    meta = json.loads((ref.task_dir / "task.json").read_text())
    assert meta["labels"] == ["economy", "politics", "sport"]
    assert meta["label_map"] == {"economy": 0, "politics": 1, "sport": 2}
    rows = load_task(ref.task_dir, "test")
    assert len(rows) == 12 and rows[1] == {"id": "test-1", "text": news_texts[41], "label": 1}
    assert sc.label_names(ref.task_dir, rows) == meta["labels"]
    assert not (folder / "task.json").exists()  # the user's folder is left as it was


def test_a_folder_of_jsonl_pairs_with_integer_labels(tmp_path, news_texts):
    folder = tmp_path / "pairs"
    folder.mkdir()
    for split in ("train", "validation", "test"):
        (folder / f"{split}.jsonl").write_text("".join(
            json.dumps({"id": f"{split}{i}", "text": news_texts[i], "text_pair": news_texts[i + 1], "label": i % 2}) + "\n"
            for i in range(8)))
    [ref] = resolve_tasks([str(folder)], suite_dir=tmp_path / "suite")
    meta = json.loads((ref.task_dir / "task.json").read_text())
    assert meta["labels"] == ["0", "1"] and "label_map" not in meta
    rows = load_task(ref.task_dir, "validation")
    assert rows[3] == {"id": "validation3", "text": news_texts[3], "text_pair": news_texts[4], "label": 1}


def test_a_folder_missing_a_split_or_a_column_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "half"
    folder.mkdir()
    _write_csv(folder / "train.csv", [{"text": "a", "label": "x"}])
    with pytest.raises(UserError, match=r"half: a task of your own needs validation.jsonl or validation.csv, "
                                        r"test.jsonl or test.csv beside train.csv"):
        resolve_tasks([str(folder)], suite_dir=tmp_path / "suite")
    for split in ("validation", "test"):
        _write_csv(folder / f"{split}.csv", [{"sentence": "a", "label": "x"}])
    with pytest.raises(UserError, match=r"validation.csv:2: column\(s\) \['text'\] missing or empty; columns present: "
                                        r"\['label', 'sentence'\]"):
        resolve_tasks([str(folder)], suite_dir=tmp_path / "suite")
