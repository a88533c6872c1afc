"""The `math` rule against hand-written references: equivalent forms score 1, wrong answers and
malformed boxes 0, a hostile answer ends at its deadline, and a bad row names rule, row and field."""

from __future__ import annotations

import time

import pytest

from hpcrlhf.config.schema import MathRuleConfig, RulesConfig
from hpcrlhf.errors import RuleError
from hpcrlhf.rewards.builtin import build_builtin
from hpcrlhf.rewards.math_answers import last_boxed, last_number
from hpcrlhf.rewards.response import Response

LABEL = "reward.sources[0].rule 'math'"
TIMEOUT_S = 3.0


def response(text: str, reference, origin: str = "train.jsonl:7") -> Response:
    return Response("What is it?", text, (), {"answer": reference}, origin)


@pytest.fixture(scope="module")
def rule():
    return build_builtin("math", RulesConfig(math=MathRuleConfig(timeout_s=TIMEOUT_S), workers=2), LABEL)


EQUIVALENT = [  # (response, reference): the same number or expression, written another way
    ("so \\boxed{\\frac{1}{2}}", "0.5"),          # a fraction, a decimal
    ("\\boxed{0.5}", "\\frac12"),                  # LaTeX's short fraction
    ("\\boxed{1/2}", "\\dfrac{1}{2}"),             # a slash, \dfrac
    ("\\boxed{\\frac{2}{4}}", "1/2"),              # not in lowest terms
    ("\\boxed{-\\frac{3}{4}}", "-0.75"),
    ("\\boxed{3.0}", 3),                           # a reference that is a number
    ("\\boxed{1,000}", "1000"),                    # thousands separated
    ("\\boxed{5\\text{ cm}}", "5"),                # units left off the reference
    ("\\boxed{5}", "5\\text{ cm}"),                # ... or off the answer
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),              # symbolic equality
    ("\\boxed{\\sqrt{2}/2}", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{x=2}", "2"),                         # an equation's right side
    ("The set is \\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces inside the box
    ("\\boxed{(1,2]}", "(1,2]"),                   # an interval
    ("first \\boxed{2}, finally \\boxed{3}", "3"),  # the last box counts
    ("\\boxed{7}", "The sum is \\boxed{7}."),      # a worked solution as reference: its last box
]
WRONG = [
    ("\\boxed{4}", "5"),
    ("\\boxed{0.33}", "\\frac13"),                 # rounded too far
    ("\\boxed{\\pi}", "3.14159"),
    ("\\boxed{a}", "1"),
    ("first \\boxed{3}, finally \\boxed{2}", "3"),  # only the last box counts
    ("The answer is 5.", "5"),                     # no box at all
    ("\\boxed{12", "12"),                          # malformed: never closed (a response cut off)
    ("\\boxed{}", "12"),                           # an empty box
    ("\\boxed{\\frac{1}{2}", "0.5"),               # braces not balanced
    ("\\boxed 12", "12"),                          # no braces
]


def test_equivalent_forms_score_1_and_wrong_or_malformed_answers_0(rule):
    cases = EQUIVALENT + WRONG
    scores = rule.scores([response(text, ref) for text, ref in cases])
    assert scores == [1.0] * len(EQUIVALENT) + [0.0] * len(WRONG), [
        (text, ref, got) for (text, ref), got in zip(cases, scores) if got != (1.0 if (text, ref) in EQUIVALENT else 0.0)]


def test_boxes_and_numbers_are_found_by_hand():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\{x\\}}") == "\\{x\\}"
    assert last_boxed("\\boxed{1} \\boxed{2") is None  # the last box unclosed: no answer, not the one before
    assert last_boxed("no box") is None
    assert last_number("is 12, no: -3.5 apples") == "-3.5"
    assert last_number("1,234 apples") == "1234" and last_number("3/4 of it") == "3/4" and last_number("none") is None


def test_last_number_mode_reads_the_last_number_written():
    rule = build_builtin("math", RulesConfig(math=MathRuleConfig(extract="last_number"), workers=1), LABEL)
    scores = rule.scores([response("12 + 30 = 42", 42), response("half: 1/2", "0.5"), response("it is 41, or 43", 42),
                          response("no idea", 42)])
    assert scores == [1.0, 1.0, 0.0, 0.0]


def test_a_hostile_answer_ends_at_its_deadline_and_the_next_check_works(rule):
    start = time.monotonic()
    scores = rule.scores([response("\\boxed{9^{9^{9^{9}}}}", "1"), response("\\boxed{2}", "2")])
    assert scores == [0.0, 1.0]
    assert time.monotonic() - start < TIMEOUT_S + 10  # killed at its deadline (and a new checker started)
    assert rule.scores([response("\\boxed{3}", "3")]) == [1.0]


@pytest.mark.parametrize("row, message", [
    ({"solution": "3"}, "has no field 'answer' (rules.math.answer_key); its fields: 'solution'"),
    ({"answer": ""}, "the reference answer '' (field 'answer', rules.math.answer_key)"),
    ({"answer": ["3"]}, "the reference answer ['3'] (field 'answer', rules.math.answer_key)"),
    ({"answer": "Answer: \\boxed{3"}, "is not a number, a non-empty text, or a text whose last \\boxed{} is complete"),
    ({"answer": "}{"}, "is not readable as math"),
])
def test_a_bad_reference_names_the_rule_the_row_and_the_field(rule, row, message):
    with pytest.raises(RuleError) as e:
        rule.scores([Response("What is it?", "\\boxed{3}", (), row, "train.jsonl:7")])
    text = str(e.value)
    assert text.startswith(LABEL) and "train.jsonl:7" in text and message in text, text
