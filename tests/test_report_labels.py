"""What a score is, said where scores are shown (issue 15, item 9): the per-layer plot does not draw bars on a
zoomed axis and its label says what the score is and which way is better (the tables: tests/test_cli.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_qattn import QAttnPlan
from hf_qattn.calibration.scoring import SCORE_MEANING, Score

pytest.importorskip("matplotlib")


def fake_result():
    scores = {layer: Score(mean=m, worst=w, count=4, cos_sim=m, rel_l1=0.0)
              for layer, (m, w) in enumerate([(0.995, 0.99), (0.93, 0.84), (0.99, 0.97), (0.985, 0.96)])}
    return SimpleNamespace(scores=scores, plan=QAttnPlan.from_scores({k: s.mean for k, s in scores.items()}, 0.25))


def test_layer_plot_has_no_bars_on_its_zoomed_axis(tmp_path):
    """Was: bars on an axis starting at 0.84, so a 0.93 layer looked a tenth as tall as a 0.995 one."""
    from hf_qattn.calibration.plots import layer_scores_figure, plot_layer_scores

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



def test_sensitivity_plot_draws_bars_from_zero_and_says_which_way(tmp_path):
    from hf_qattn.calibration.plots import layer_sensitivity_figure, plot_layer_sensitivity

    scores = {layer: SimpleNamespace(mean=m, worst=w) for layer, (m, w) in
              enumerate([(0.02, 0.05), (-0.01, 0.01), (0.08, 0.2), (0.03, 0.04)])}
    # from_scores marks the lowest int8: rank by the negated gain, as calibrate does for these objectives
    result = SimpleNamespace(scores=scores, plan=QAttnPlan.from_scores({k: -s.mean for k, s in scores.items()}, 0.25))
    ax = layer_sensitivity_figure(result, "t", "NLL drop with this layer int8\nhigher = gains more").axes[0]
    low, high = ax.get_ylim()
    assert low <= -0.01 and high >= 0.2  # zero, the negative gain and the worst input all on the axis
    assert len(ax.patches) == 4 and "higher = gains more" in ax.get_ylabel()
    colors = [tuple(round(c, 3) for c in patch.get_facecolor()[:3]) for patch in ax.patches]
    assert colors[2] != colors[0]  # the int8 layer (largest gain) stands out
    path = plot_layer_sensitivity(result, tmp_path / "s.png", "t", "label")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
