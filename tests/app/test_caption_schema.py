"""python -m app.caption --json-schema FILE and --thinking-budget: records whose caption is the parsed object."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from app import caption
from tests.app.conftest import write_videos
from tests.app.test_caption import read_records

# bounded everywhere: the random model never ends a string or an array by itself (mm/constraints.py)
SCHEMA = {
    "type": "object",
    "properties": {
        "objects": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "maxItems": 2},
        "count": {"enum": [0, 1, 2, 3]},
        "moving": {"type": "boolean"},
        "scene": {"type": "object", "properties": {"indoor": {"type": "boolean"}}, "required": ["indoor"],
                  "additionalProperties": False},
    },
    "required": ["objects", "count", "moving", "scene"],
    "additionalProperties": False,
}  # fmt: skip
VIDEO = ["--fps", "4", "--max-frames", "8", "--seed", "3", "--preset", "thinking"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("schema_videos")
    write_videos(root, 3)
    (root / "schema.json").write_text(json.dumps(SCHEMA))
    return root


@pytest.mark.slow
def test_captions_are_objects_that_follow_the_schema(folder, tmp_path):
    out = tmp_path / "captions.jsonl"
    options = ["--json-schema", str(folder / "schema.json"), "--max-new-tokens", "160", *VIDEO]
    assert caption.main([str(folder), "--out", str(out), *options, "--thinking", "--thinking-budget", "4"]) == 0
    records = read_records(out)
    assert len(records) == 3
    for record in records:
        assert record["error"] is None, record["error"]
        assert isinstance(record["caption"], dict)
        jsonschema.validate(record["caption"], SCHEMA)
        assert record["thinking"] and record["finish_reason"] == "stop"  # the budget closed the thinking


@pytest.mark.slow
def test_a_caption_cut_short_is_an_error_record(folder, tmp_path):
    out = tmp_path / "captions.jsonl"
    assert caption.main([str(folder), "--out", str(out), "--json-schema", str(folder / "schema.json"),
                         "--max-new-tokens", "4", *VIDEO]) == 0  # fmt: skip
    records = read_records(out)
    assert len(records) == 3
    for record in records:
        assert record["caption"] is None and "not complete JSON for --json-schema" in record["error"]
        assert "finish_reason length" in record["error"]


def test_bad_schema_files_and_budgets_are_refused_before_any_work(tmp_path, capsys):
    files = {"notjson.json": "{oops", "list.json": "[1, 2]", "invalid.json": json.dumps({"type": "strin"})}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "out.jsonl"
    for options, message in ((["--json-schema", str(tmp_path / "notjson.json")], "notjson.json: Expecting"),
                             (["--json-schema", str(tmp_path / "missing.json")], "missing.json: [Errno 2]"),
                             (["--json-schema", str(tmp_path / "list.json")], "a schema is a JSON object, got list"),
                             (["--json-schema", str(tmp_path / "invalid.json")], "not a valid JSON schema: 'strin'"),
                             (["--thinking-budget", "5"], "--thinking-budget 5 needs --thinking"),
                             (["--thinking", "--thinking-budget", "-1"], "a value >= 0")):  # fmt: skip
        with pytest.raises(SystemExit) as exit:
            caption.main([str(tmp_path), "--out", str(out), *options])
        assert exit.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()
