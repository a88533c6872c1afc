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


@pytest.mark.parametrize("text, where, key", [
    ('{"prompt": "1+1=", "response": "2"}\n{"prompt": "1+1=", "response": "2", "prompt": "9+9="}\n', ":2", "prompt"),
    ('{"prompt": "a", "response": "b", "meta": {"id": 1, "id": 2}}\n', ":1", "id"),  # nested: the same
])
def test_a_key_twice_in_a_jsonl_row_is_refused_with_file_and_line(tmp_path, text, where, key):
    """JSON keeps the last value of a repeated key: the row would train on a prompt the file shows second."""
    f = tmp_path / "d.jsonl"
    f.write_text(text)
    with pytest.raises(DataError) as e:
        read_rows(str(f))
    assert str(e.value) == (f"{f}{where}: duplicate key {key!r} (JSON would silently keep only its last value); "
                            "remove one of them")


def test_a_key_twice_in_a_json_file_names_its_row(tmp_path):
    f = tmp_path / "d.json"
    f.write_text('{"data": [{"prompt": "a", "response": "b"},\n {"prompt": "c", "response": "d", "response": "e"}]}')
    with pytest.raises(DataError, match=r"d.json: row 2: duplicate key 'response' \(JSON would silently keep"):
        read_rows(str(f))


def test_a_jsonl_line_longer_than_any_row_is_refused_before_it_fills_the_memory(tmp_path, monkeypatch):
    import hpcrlhf.data.sources as sources

    monkeypatch.setattr(sources, "MAX_LINE_CHARS", 1000)  # the limit is 64 Mi characters: a 1 GB line
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + "x" * 5000)  # no line break after it
    with pytest.raises(DataError, match=rf"{f}:2: a line of more than 1,000 characters; a JSON Lines row is one"):
        read_rows(str(f))
    f.write_text(json.dumps({"prompt": "a", "response": "b" * 900}) + "\n")  # up to the limit: read
    assert read_rows(str(f))[0].data["response"] == "b" * 900


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_data_path_that_is_no_file_or_folder_is_named_as_such(tmp_path, special):
    import os

    if special == "fifo":
        special = str(tmp_path / "rows.jsonl")
        os.mkfifo(special)  # reading it would wait for a writer forever
    with pytest.raises(DataError, match=f"data path '{special}' is not a regular file or a folder; give a data file"):
        read_rows(special)
