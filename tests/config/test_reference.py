"""`hpcrlhf config KIND --markdown`: a job kind's settings as a markdown page (docs/settings/).

Run through the CLI as a user runs it; the pages checked in under docs/settings/ are held to this
output by tests/test_docs.py.
"""

from __future__ import annotations

import re

import pytest

from hpcrlhf.cli import main
from hpcrlhf.config.loader import settings
from hpcrlhf.config.schema import JOB_CONFIGS, GenerateConfig

ROW = re.compile(r"^\| `(?P<key>[^`]+)` \|")


def markdown(capsys, *argv: str) -> str:
    assert main(["config", *argv, "--markdown"]) == 0
    return capsys.readouterr().out


def rows(page: str) -> dict[str, list[str]]:
    """Key -> its table cells (type, default, documentation), pipes inside cells escaped as `\\|`."""
    found = {}
    for line in page.splitlines():
        match = ROW.match(line)
        if match and match["key"] != "key":
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            assert len(cells) == 4, line  # an unescaped | or a newline in a cell breaks the table
            found[match["key"]] = cells[1:]
    return found


@pytest.mark.parametrize("kind", [*JOB_CONFIGS, "generate"])
def test_every_setting_of_a_kind_is_a_row_with_its_documentation(kind, capsys):
    page = markdown(capsys, kind)
    table = rows(page)
    cls = GenerateConfig if kind == "generate" else JOB_CONFIGS[kind]
    for setting in settings(cls):
        key = ".".join(setting.path)
        if setting.section:
            assert re.search(rf"^#+ `{re.escape(key)}`$", page, re.M), key
        else:
            assert key in table, key
            first_words = " ".join(setting.doc.split()[:4])
            assert first_words.replace("|", "\\|") in table[key][2], (key, first_words)


def test_a_page_has_section_headings_types_defaults_and_list_entries(capsys):
    page = markdown(capsys, "ppo")
    assert page.startswith("# `ppo` settings\n")
    assert "hpcrlhf config ppo --markdown" in page and "python -m hpcrlhf.config.reference docs/settings" in page
    assert "\n## `placement`\n" in page and "\n### `placement.actor`\n" in page
    table = rows(page)
    kind, default, doc = table["ppo.advantage_estimator"]
    assert kind.startswith("one of `gae`, `grpo`, `dr_grpo`") and default == "`gae`" and "group-normalised" in doc
    assert table["optim.lr"][:2] == ["float", "`3.0e-05`"]
    assert table["model.path"][0] == "path"  # a NonEmpty string
    assert table["train.micro_batch_size"][:2] == ["int or null", "`null`"]
    assert table["optim.betas"][:2] == ["[float, float]", "`[0.9, 0.95]`"]
    # the entries of a list of sections get their own rows, so `{rule: ..., weight: ...}` is documented
    assert table["reward.sources"][1] == ("`[{model: null, rule: task, env: false, url: null, token_file: null, token_env: null, "
                                          "weight: 1.0, normalize: true, servers: 0}]`")
    assert table["reward.sources[].rule"][:2] == ["str or null", "`null`"]
    assert "weighted sum" in table["reward.sources[].weight"][2]


def test_generate_documents_its_optional_reward_section(capsys):
    table = rows(markdown(capsys, "generate"))
    assert table["reward"][:2] == ["mapping or null", "`null`"]
    assert "reward.sources[].model" in table and "reward.clip" in table


def test_with_a_recipe_the_page_shows_its_values(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout: {samples_per_prompt: 8}\n")
    page = markdown(capsys, "ppo", "--config", str(recipe), "--set", "optim.lr=1e-6")
    assert "| key | type | value | documentation |" in page
    table = rows(page)
    assert table["rollout.samples_per_prompt"][1] == "`8`" and table["optim.lr"][1] == "`1.0e-06`"


def test_a_bad_setting_is_refused_as_without_markdown(capsys):
    assert main(["config", "ppo", "--markdown", "--set", "optim.lr=abc"]) == 2
    assert "optim.lr" in capsys.readouterr().err
