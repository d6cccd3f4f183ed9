"""The generated reference pages are current, and the README is a landing page."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_generated_pages_are_current():
    got = subprocess.run([sys.executable, str(ROOT / "tools" / "docs.py"), "--check"], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr


def test_the_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import docs
    finally:
        sys.path.pop(0)
    (tmp_path / "docs").mkdir()
    for name, make in docs.PAGES.items():
        (tmp_path / "docs" / name).write_text(make())
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    assert docs.main(["--check"]) == 0
    (tmp_path / "docs" / "benchmarks.md").write_text("an edited table\n")
    assert docs.main(["--check"]) == 1


def test_the_benchmark_table_names_every_result_with_its_machine_and_date():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import docs
    finally:
        sys.path.pop(0)
    text = docs.benchmarks()
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        row = next(line for line in text.splitlines() if f"`{path.name}`" in line)
        cells = [c.strip() for c in row.split("|")]
        assert cells[3] and cells[4].startswith("2026-"), row  # machine, date


def test_the_readme_is_a_landing_page_linking_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"
