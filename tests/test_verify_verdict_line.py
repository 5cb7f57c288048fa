"""verify's one-line verdict says when the tokens were not checked (`verify --no-reference`): a PASS
without the token-exact check reads "PASS (tokens not checked)", never a bare PASS."""

from __future__ import annotations

from colibri_plan.formats.report import RunReport
from colibri_plan.verify import make_verdict, verdict_line

HIT = {"vram": 0.0, "ram_pinned": 0.6, "lru": 0.1, "disk": 0.3}
PREDICTED = RunReport(tok_s=10.0, decode_s_per_token=0.1, hit_rate=dict(HIT))


def _line(tok_s: float, token_exact):
    measured = RunReport(tok_s=tok_s, decode_s_per_token=1 / tok_s, hit_rate=dict(HIT))
    return verdict_line(make_verdict(PREDICTED, measured, token_exact))


def test_pass_without_the_token_check_says_so():
    line = _line(11.0, None)
    assert line.startswith("verdict: PASS (tokens not checked) - token-exact not checked; ")
    assert "measured/predicted 1.10 (within +-25%)" in line


def test_checked_pass_and_fails_keep_their_words():
    assert _line(11.0, True).startswith("verdict: PASS - token-exact yes; ")
    assert _line(11.0, False).startswith("verdict: FAIL - token-exact NO; ")  # wrong tokens: FAIL
    assert _line(5.0, None).startswith(
        "verdict: FAIL - token-exact not checked; tok/s measured/predicted 0.50")
