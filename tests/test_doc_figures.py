"""Every measured figure that README.md and docs/*.md quote with a result-file tag is what that file holds
(rounded as printed); no performance figure goes without a tag (or a "not measured" / "unrecorded"
mark); bench/results/README.md lists every result file with its date. The convention is in
tests/_doc_figures.py and bench/results/README.md ("Figures in the docs")."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import _doc_figures as df
import pytest

RESULTS_README = df.RESULTS / "README.md"


def _errors(docs) -> list[str]:
    out = []
    for doc in docs:
        for fig, file, expr in df.scan(doc)[0]:
            why = df.check(fig, file, expr)
            if why:
                out.append(f"{fig.doc}:{fig.line}: {why}")
    return out


def test_tagged_figures_are_what_their_files_hold():
    tagged = [t for doc in df.DOCS for t in df.scan(doc)[0]]
    assert len(tagged) >= 250 and len(df.scan(df.ROOT / "README.md")[0]) >= 5  # none lost by the scanner
    assert len(df.scan(df.ROOT / "docs" / "measured.md")[0]) >= 9
    assert _errors(df.DOCS) == []


def test_no_performance_figure_goes_untagged():
    found = [f"{f.doc}:{f.line}: {f.text}" for doc in df.DOCS for f in df.scan(doc)[1]]
    assert found == [], ("performance figures without a result-file tag: tag each (`<!-- fig FILE: KEY "
                         "-->`), or mark it `<!-- fig not measured: why -->` / `<!-- fig unrecorded: why "
                         "-->` (bench/results/README.md, \"Figures in the docs\")")


@pytest.fixture
def readme_copy(tmp_path):
    """A copy of docs/measured.md (the README's measured claims) to break."""
    return Path(shutil.copy(df.ROOT / "docs" / "measured.md", tmp_path / "measured.md"))


def test_a_wrong_figure_fails(readme_copy):
    text = readme_copy.read_text(encoding="utf-8")
    assert "**49.20 tok/s" in text
    readme_copy.write_text(text.replace("**49.20 tok/s", "**49.30 tok/s", 1), encoding="utf-8")
    errors = _errors([readme_copy])
    assert len(errors) == 1 and "49.30 is on no line of h200-trunk/summary.txt" in errors[0]
    # a value rounded one digit off fails too: 30.4 ms is 30.40 ms to the file, not 30.5
    readme_copy.write_text(text.replace("takes 30.4 ms", "takes 30.5 ms", 1), encoding="utf-8")
    assert ["30.5 but h200-cuda-ffn/trunk-prefill-final.json" in e for e in _errors([readme_copy])] == [True]


def test_a_wrong_key_or_file_and_an_untagged_figure_fail(readme_copy):
    text = readme_copy.read_text(encoding="utf-8")
    peer = "peer-llamacpp-cpu-h26q4.json: results.int8.metrics.decode"
    bad = text.replace("verdict.tok_s_ratio", "verdict.tok_ratio", 1)
    bad = bad.replace(peer, peer.replace("cpu", "gpu"), 1)
    readme_copy.write_text(bad + "\nThe engine decodes 123.4 tok/s here.\n", encoding="utf-8")
    errors = _errors([readme_copy])
    assert any("no key 'tok_ratio'" in e for e in errors) and any("no result file" in e for e in errors)
    assert [f.text for f in df.scan(readme_copy)[1]] == ["123.4 tok/s"]
    readme_copy.write_text(bad + "\nThe engine decoded 123.4 tok/s once (unrecorded).\n", encoding="utf-8")
    assert df.scan(readme_copy)[1] == []
    # an inline mark covers the figures since the previous tag only
    readme_copy.write_text(bad + "\nIt decoded 123.4 tok/s<!-- fig unrecorded: gone --> in 5.0 ms.\n",
                           encoding="utf-8")
    assert [f.text for f in df.scan(readme_copy)[1]] == ["5.0 ms"]


def test_expressions_ranges_and_rounding():
    assert df.matches(49.19659, "49.20") and df.matches(49.19659, "49.2")
    assert not df.matches(49.19659, "49.21")
    assert df.matches(1090.06, "1,090") and not df.matches(1090.6, "1090")
    files = df.files_of("h200-cuda-ffn/ffn-{1,2,3}.json")
    assert [f.name for f in files] == ["ffn-1.json", "ffn-2.json", "ffn-3.json"]
    with pytest.raises(df.FigureError, match="no result file"):
        df.files_of("../README.md")


# ---- bench/results/README.md --------------------------------------------------------------------------

def _rows() -> list[tuple[list[str], str]]:
    """(file names, date) of each table row of bench/results/README.md."""
    rows = []
    for line in RESULTS_README.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 5 or not re.fullmatch(r"\d{4}-\d\d-\d\d", cells[3]):
            continue
        rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[3]))
    return rows


def _expand(name: str) -> list[Path]:
    if name.endswith("/"):
        return sorted(p for p in (df.RESULTS / name).rglob("*") if p.is_file())
    m = re.search(r"\{([^}]*)\}", name)
    names = [name[:m.start()] + a + name[m.end():] for a in m.group(1).split(",")] if m else [name]
    return [df.RESULTS / n for n in names]


def test_results_readme_lists_every_file():
    on_disk = {p for p in df.RESULTS.rglob("*") if p.is_file() and p != RESULTS_README}
    listed = {p for names, _ in _rows() for n in names for p in _expand(n)}
    assert sorted(str(p.relative_to(df.RESULTS)) for p in listed - on_disk) == [], "listed, not there"
    assert sorted(str(p.relative_to(df.RESULTS)) for p in on_disk - listed) == [], "there, not listed"


def _git_date(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ad", "--date=short", "--", str(path)],
                             cwd=df.ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def test_results_readme_dates_are_the_files_commits():
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=df.ROOT,
                             capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("no full git history here: the dates are those of the commits that wrote each file")
    wrong = []
    for names, date in _rows():
        dates = {_git_date(p) for n in names for p in _expand(n)}
        if None in dates:
            continue  # not committed yet (a run being added): its date comes with its commit
        if date != max(dates):
            wrong.append(f"{', '.join(names)}: {date}, committed {max(dates)}")
    assert wrong == []
