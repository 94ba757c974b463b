"""The validation report's Markdown."""

from __future__ import annotations

from trainyard import data as dq


def test_markdown_lists_every_expectation(digits, spec):
    bad = digits.copy()
    bad.loc[0, "source"] = "fax|x"
    markdown = dq.validate(bad, spec).to_markdown()
    lines = markdown.splitlines()
    total = len(dq.expectation_configs(spec)) + 4
    assert lines[0] == f"**FAILED**: {total - 1} of {total} expectations passed"
    assert lines[2] == "| expectation | column | success | observed | unexpected | sample |"
    assert len(lines) == 4 + total + 2  # then the missing values per column
    assert lines[-1] == "**missing values** per column (null cells): none"
    assert "| expect_column_values_to_be_in_set | source | **no** |  | 1 | 'fax\\|x' |" in lines
