"""What the report's figures print: text a reader can read, whatever matplotlib version draws them."""

from __future__ import annotations


def test_every_tick_label_renders_as_text_not_mathtext_source() -> None:
    """Log axes used matplotlib's mathtext labels ('$\\mathdefault{10^{1}}$'), printed raw because the report turns
    mathtext off for names from files; every figure's tick labels must be plain text."""
    import matplotlib

    import planner
    from reports import analyze, options_for
    from reports.figures import FIGURES, png_bytes
    from tests.reports._fixtures import three_rank_profile

    prof = three_rank_profile()
    plan = planner.solve(prof, global_batch=700)
    rep = analyze(prof, plan, options_for(plan))
    seen = 0
    with matplotlib.rc_context({"text.parse_math": False}):
        for key, _, build in FIGURES:
            fig = build(rep)
            if fig is None:
                continue
            png_bytes(fig)  # draws: the tick labels exist from here on
            for ax in fig.get_axes():
                for label in [*ax.get_xticklabels(), *ax.get_yticklabels()]:
                    text = label.get_text()
                    seen += bool(text)
                    assert "$" not in text and "mathdefault" not in text, (key, text)
    assert seen > 20
