import json

import pytest

from hpcrlhf.data.sources import read_rows, require_text
from hpcrlhf.errors import DataError


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_rows_carry_file_and_line(tmp_path):
    f = write(tmp_path / "d.jsonl", [json.dumps({"prompt": "1+1=", "response": "2"}), "", json.dumps({"prompt": "2+2=", "response": "4"})])
    rows = read_rows(f)
    assert [r.origin for r in rows] == [f"{f}:1", f"{f}:3"]


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": "1+1="}', "field 'response' is missing; the row has: prompt (or set data.response_key"),
    ('{"prompt": "1+1=", "response": ""}', "field 'response' is empty"),
    ('{"prompt": 5, "response": "x"}', "field 'prompt' must be a string, got 5"),
    ('{"prompt": "1+1=", "response": "2"', "invalid JSON"),
    ('[1, 2]', "expected a JSON object per line"),
])
def test_bad_rows_are_reported_with_file_and_line(tmp_path, line, needle):
    good = json.dumps({"prompt": "1+1=", "response": "2"})
    f = write(tmp_path / "bad.jsonl", [good, good, line])
    with pytest.raises(DataError) as e:
        require_text(read_rows(f), ["prompt", "response"], key_option={"response": "data.response_key"})
    assert f"{f}:3" in str(e.value) and needle in str(e.value)


def test_json_list_and_parquet(tmp_path):
    import datasets

    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"prompt": "a", "response": "b"}, {"prompt": "c"}]))
    with pytest.raises(DataError, match=r"d.json: row 2: field 'response' is missing"):
        require_text(read_rows(str(f)), ["prompt", "response"])
    pq = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"prompt": "a", "response": "b"}] * 3).to_parquet(str(pq))
    rows = read_rows(str(pq))
    assert len(rows) == 3 and rows[2].origin.endswith("row 3")


def test_missing_paths_and_offline_hub(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="does not exist"):
        read_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="unknown data file type"):
        read_rows(write(tmp_path / "d.txt", ["x"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="hub is off"):
        read_rows("someorg/somedata")
