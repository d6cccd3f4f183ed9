"""The generated reference pages are current, and the README is a landing page."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _docs():
    """``tools/docs.py`` as a module (tools/ is not a package)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import docs
    finally:
        sys.path.pop(0)
    return docs


def test_the_generated_pages_are_current():
    got = subprocess.run([sys.executable, str(ROOT / "tools" / "docs.py"), "--check"], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr


def test_the_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    docs = _docs()
    (tmp_path / "docs").mkdir()
    for name, make in docs.PAGES.items():
        (tmp_path / "docs" / name).write_text(make())
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    assert docs.main(["--check"]) == 0
    (tmp_path / "docs" / "benchmarks.md").write_text("an edited table\n")
    assert docs.main(["--check"]) == 1


def test_the_benchmark_table_names_every_result_with_its_machine_and_date():
    docs = _docs()
    text = docs.benchmarks()
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        row = next(line for line in text.splitlines() if f"`{path.name}`" in line)
        cells = [c.strip() for c in row.split("|")]
        assert cells[3] and re.fullmatch(r"\d{4}-\d{2}-\d{2}.*", cells[4]), row  # machine, date (any year)


def test_the_readme_is_a_landing_page_linking_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"


def test_a_result_named_by_its_cpu_shows_that_cpu_and_its_benchmarks_headline(tmp_path, monkeypatch):
    docs = _docs()
    doc = {"benchmark": "peers_avx512_intel", "date": "2026-12-01",
           "cpu": {"model": "Intel(R) Xeon(R) Processor", "vendor": "GenuineIntel", "isa": "avx512", "cores": 2,
                   "tag": "avx512_intel"},
           "ratios": {"sgd_vs_fbgemm": {"ratio": 2.5}}, "env": {"torch": "2.13.0+cpu", "cpu_count": 2, "device": "cpu"}}
    (tmp_path / "peers_avx512_intel_cpu.json").write_text(json.dumps(doc))
    monkeypatch.setattr(docs, "RESULTS", tmp_path)
    row = next(line for line in docs.benchmarks().splitlines() if "`peers_avx512_intel_cpu.json`" in line)
    cells = [c.strip() for c in row.split("|")]
    assert cells[3].startswith("Intel(R) Xeon(R) Processor (avx512), 2 cores"), row  # the machine: its CPU
    assert "ratios.sgd_vs_fbgemm.ratio 2.5" in cells[5], row  # the headline of peers, the tag dropped
