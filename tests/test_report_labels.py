"""What a score is, said where scores are shown (issue 15, item 9): the per-layer plot does not draw bars on a
zoomed axis and its label says what the score is and which way is better (the tables: tests/test_cli.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_qattn import QAttnPlan
from hf_qattn.scoring import SCORE_MEANING, Score

pytest.importorskip("matplotlib")


def fake_result():
    scores = {layer: Score(mean=m, worst=w, count=4, cos_sim=m, rel_l1=0.0)
              for layer, (m, w) in enumerate([(0.995, 0.99), (0.93, 0.84), (0.99, 0.97), (0.985, 0.96)])}
    return SimpleNamespace(scores=scores, plan=QAttnPlan.from_scores({k: s.mean for k, s in scores.items()}, 0.25))


def test_layer_plot_has_no_bars_on_its_zoomed_axis(tmp_path):
    """Was: bars on an axis starting at 0.84, so a 0.93 layer looked a tenth as tall as a 0.995 one."""
    from hf_qattn.report import layer_scores_figure, plot_layer_scores

    ax = layer_scores_figure(fake_result(), "t").axes[0]
    low, high = ax.get_ylim()
    assert high == 1.0 and 0.0 < low <= 0.84  # zoomed onto the scores, the worst one included
    assert not ax.containers and not ax.patches  # points and lines, no bars whose length would mislead
    label = ax.get_ylabel()
    assert "cos_sim*(1-rel_l1)" in label and "higher is better" in label and "zoomed" in label
    path = plot_layer_scores(fake_result(), tmp_path / "s.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_score_meaning_says_what_and_which_way():
    assert "CosSim·(1 − RelL1)" in SCORE_MEANING and "higher is better" in SCORE_MEANING
    assert "int8" in SCORE_MEANING

