"""benchmarks.common.write_section: a rerun puts its measurement on top and keeps what was there."""

from __future__ import annotations

import benchmarks.common as common


def test_write_section_keeps_earlier_results_and_other_sections(tmp_path, monkeypatch):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## A\n\nold table\n\n### A note by hand\n\nkept\n\n## B\n\nb stays\n")
    monkeypatch.setattr(common, "BENCHMARKS_MD", md)
    monkeypatch.setattr(common, "revision", lambda: "abc1234")
    common.write_section("A", "python -m benchmarks.a", "new table", threads=1)
    common.write_section("C", "python -m benchmarks.c", "c table", threads=1)
    text = md.read_text()
    a, rest = text.split("## B\n")
    assert a.index("new table") < a.index("Earlier measurements of this section") < a.index("old table")
    assert "### A note by hand\n\nkept" in a and "Command: `python -m benchmarks.a`" in a and "revision abc1234" in a
    assert rest.startswith("\nb stays\n") and rest.rstrip().endswith("c table") and text.count("## A\n") == 1
