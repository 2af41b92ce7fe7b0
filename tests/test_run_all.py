"""benchmarks/run_all.py: regenerating RESULTS.md replaces only the sections it ran."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import run_all  # noqa: E402


def test_run_all_only_replaces_its_sections_and_keeps_the_others(tmp_path):
    old = tmp_path / "RESULTS.md"
    old.write_text("# Benchmark results\n\nMachine: cpu=Old\n\n## A\n\n`python a.py`\n\nold a\n\n"
                   "## B\n\n`python b.py`\n\nold b\n")
    merged = run_all._merge(old, {"B": "## B\n\nnew b\n", "C": "## C\n\nnew c\n"})
    assert [m.split("\n", 1)[0] for m in merged] == ["## A", "## B", "## C"]
    assert "old a" in merged[0] and "Machine: cpu=Old" in merged[0]  # the header's machine moves into it
    assert merged[1] == "## B\n\nnew b\n"
