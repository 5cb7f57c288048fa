"""scripts/demo.sh's closing summary (issue 29: it announced a FAIL that did not happen): the summary's
Python, taken from the script itself, run over verify reports that pass and that fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "scripts" / "demo.sh"


def _summary(tmp_path, verdicts: dict[str, bool]) -> str:
    text = DEMO.read_text()
    code = text[text.index('say "done"'):].split("<<'EOF'\n", 1)[1].split("\nEOF", 1)[0]
    for name, ok in verdicts.items():
        (tmp_path / f"verify-{name}.json").write_text(json.dumps({"verdict": {
            "ok": ok, "token_exact": True, "tok_s_ratio": 0.9 if ok else 0.5, "hit_rate_diff_points": 0.0}}))
    return subprocess.run([sys.executable, "-", str(tmp_path)], input=code, capture_output=True, text=True,
                          check=True).stdout


def test_all_passed_announces_no_fail(tmp_path):
    out = _summary(tmp_path, {"auto": True, "1.5gb": True, "2.5gb-calibrated": True})
    assert "FAIL" not in out and "fail" not in out and "every verify report passed" in out
    assert out.count("PASS") == 3


@pytest.mark.parametrize("verdicts, words", [
    ({"auto": False, "1.5gb": True, "2.5gb-calibrated": True}, ["verify-auto.json failed", "calibration"]),
    ({"auto": True, "1.5gb": True, "2.5gb-calibrated": False},
     ["verify-2.5gb-calibrated.json failed, the calibrated plan among them"]),
])
def test_a_failure_is_named(tmp_path, verdicts, words):
    out = _summary(tmp_path, verdicts)
    assert "every verify report passed" not in out and out.count("FAIL") == 1
    for w in words:
        assert w in out
