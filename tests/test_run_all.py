"""benchmarks/run_all.py: regenerating RESULTS.md replaces only the sections it ran."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import run_all


def test_run_all_only_replaces_its_sections_and_keeps_the_others(tmp_path):
    old = tmp_path / "RESULTS.md"
    old.write_text(
        "# Benchmark results\n\nMachine: cpu=Old\n\n## A\n\n`python a.py`\n\nold a\n\n## B\n\n`python b.py`\n\nold b\n"
    )
    merged = run_all._merge(old, {"B": "## B\n\nnew b\n", "C": "## C\n\nnew c\n"})
    assert [m.split("\n", 1)[0] for m in merged] == ["## A", "## B", "## C"]
    assert "old a" in merged[0] and "Machine: cpu=Old" in merged[0]  # the header's machine moves into it
    assert merged[1] == "## B\n\nnew b\n"


def test_a_full_run_replaces_its_own_devices_sections_and_keeps_the_others(tmp_path):
    old = tmp_path / "RESULTS.md"
    old.write_text(
        "# Benchmark results\n\n## A\n\nMachine: cpu\n\nold a\n\n## Gone\n\nMachine: cpu\n\nstale\n\n"
        "## GPU: A\n\nDevice: H100\n\nMachine: gpu\n\nold gpu a\n"
    )
    gpu_run = run_all._combined(
        old,
        {"GPU: A": "## GPU: A\n\nnew gpu a\n", "GPU: B": "## GPU: B\n\nnew b\n"},
        ["GPU: A", "GPU: B"],
        gpu=True,
        only=False,
    )
    assert [s.split("\n", 1)[0] for s in gpu_run] == ["## A", "## Gone", "## GPU: A", "## GPU: B"]
    assert "old a" in gpu_run[0] and "new gpu a" in gpu_run[2]
    cpu_run = run_all._combined(old, {"A": "## A\n\nnew a\n"}, ["A"], gpu=False, only=False)
    assert [s.split("\n", 1)[0] for s in cpu_run] == ["## A", "## GPU: A"]  # a section no benchmark writes goes
    assert cpu_run[0] == "## A\n\nnew a\n" and "old gpu a" in cpu_run[1]


def test_a_new_section_joins_its_devices_sections(tmp_path):
    old = tmp_path / "RESULTS.md"
    old.write_text("# Benchmark results\n\n## A\n\nMachine: cpu\n\nold a\n\n## GPU: A\n\nMachine: gpu\n\nold gpu a\n")
    merged = run_all._merge(old, {"GPU: B": "## GPU: B\n\nnew gpu b\n", "B": "## B\n\nnew b\n"})
    assert [m.split("\n", 1)[0] for m in merged] == ["## A", "## B", "## GPU: A", "## GPU: B"]
