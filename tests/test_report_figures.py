"""The report's figures fit a two-column paper as saved (issue 44.5): a column (3.5 in) or both columns (7 in) wide,
panels wrapped into rows, and one legend that keys every marker kind drawn (hollow: fewer seeds or capped fits; the
star: the best lr). They were one row of panels, up to 13.1 in wide, with the legends beside them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image
from test_report import write_lr_search, write_sweep

from mdl.report.sweep import load_sweep
from mdl.report.stats import build_cells, coverage
from mdl.report.style import COLUMN_WIDTH, TWO_COLUMN_WIDTH

DPI = 200  # mdl.report.figures._save


@pytest.fixture
def legends(monkeypatch) -> dict[str, list[str]]:
    """File name -> the entries of the figure's legends, recorded as each figure is saved (the real save runs)."""
    import mdl.report.figures as figures_module
    import mdl.report.lr as lr_module

    found: dict[str, list[str]] = {}
    save = figures_module._save

    def recording(fig, path: Path) -> Path:
        found[path.name] = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        assert not [ax for ax in fig.axes if ax.get_legend() is not None], path.name  # one legend, below the panels
        return save(fig, path)

    for module in (figures_module, lr_module):
        monkeypatch.setattr(module, "_save", recording)
    return found


def saved_width(png: Path) -> float:
    """Inches across, as saved: the PNG's pixels at the report's dpi, checked against the SVG's own width."""
    inches = Image.open(png).size[0] / DPI
    svg_pt = float(re.search(r'<svg[^>]* width="([\d.]+)pt"', png.with_suffix(".svg").read_text()).group(1))
    assert svg_pt / 72 == pytest.approx(inches, abs=0.01), png.name
    return inches


@pytest.mark.slow
def test_figures_are_a_column_or_two_wide_and_key_every_marker(tmp_path: Path, legends) -> None:
    from mdl.report.figures import loss_figures, scaling_figures
    from mdl.report.lr import lr_figures

    sweep = load_sweep([write_sweep(tmp_path / "sweep", with_erasers=False)])
    cells = build_cells(sweep)
    mlp = [c for c in cells if c.arch == "mlp" and c.row[sweep.row_keys.index("depth")] == 2]  # widths 64 and 128
    files, _ = scaling_figures(sweep, mlp, tmp_path, coverage(sweep, cells).max_seeds)
    files += loss_figures(sweep, mlp, tmp_path)[0]
    lr_sweep = load_sweep([write_lr_search(tmp_path / "lr")])
    files += lr_figures(lr_sweep, build_cells(lr_sweep), tmp_path)[0]
    widths = {f.path.name: saved_width(f.path) for f in files}
    assert widths == {
        "mdl_vs_width_mlp.png": pytest.approx(COLUMN_WIDTH),  # one panel: a column
        "val_loss_mlp.png": pytest.approx(TWO_COLUMN_WIDTH),  # two panels: two columns
        "lr_mlp.png": pytest.approx(COLUMN_WIDTH),
    }
    # MLP + QLEACE at width 128 has 2 of 3 seeds: drawn hollow, and the key says what hollow means
    assert legends["mdl_vs_width_mlp.png"] == ["Control", "LEACE", "QLEACE", "chance", "3 seeds", "fewer than 3 seeds"]
    assert legends["val_loss_mlp.png"] == ["Control", "LEACE", "QLEACE", "chance", "mean over seeds", "one seed"]
    assert legends["lr_mlp.png"] == ["Control", "LEACE", "best lr (3+ lrs tried)", "capped fits (under-trained)"]


def test_figure1_is_a_column_wide_for_a_few_erasers_and_two_for_many(tmp_path: Path) -> None:
    import torch

    from mdl.report.figure1 import _draw_figure1

    images = torch.rand(2, 1, 4, 4)
    few = _draw_figure1(
        [(label, images) for label in ("original", "leace", "random (rank 2)")], tmp_path / "a.png", 0, 1
    )
    labels = ("original", "leace", "qleace", "alf_qleace", "gradient", "random (rank 9)")
    many = _draw_figure1([(label, images) for label in labels], tmp_path / "b.png", 0, 1)
    assert saved_width(few) == pytest.approx(COLUMN_WIDTH) and saved_width(many) == pytest.approx(TWO_COLUMN_WIDTH)
