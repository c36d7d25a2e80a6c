"""How every figure of the report looks: fonts a paper can embed, one set of font sizes, the paper's
eraser names and one colour per eraser. Figures take these from here and set none of their own, so
a figure pasted into the paper matches the others (and the paper's Appendix C table).

Importing this module selects matplotlib's Agg backend (no display needed) and sets its rcParams:
the report draws to files only.
"""

from __future__ import annotations

import logging
import textwrap
from typing import Iterable

import matplotlib

matplotlib.use("Agg")

FONT_SIZE = 8  # pt: axis labels, titles and body text of a one-column figure
SMALL_FONT_SIZE = 7  # pt: tick labels and legends, one step below the labels they sit beside
RC_PARAMS = {
    "pdf.fonttype": 42,  # TrueType (Type 42) in PDFs, not Type 3: what venues' PDF checks accept
    "ps.fonttype": 42,
    "svg.fonttype": "none",  # SVG text stays text
    "font.size": FONT_SIZE,
    "axes.titlesize": FONT_SIZE,
    "axes.labelsize": FONT_SIZE,
    "figure.titlesize": FONT_SIZE,
    "legend.fontsize": SMALL_FONT_SIZE,
    "legend.title_fontsize": SMALL_FONT_SIZE,
    "xtick.labelsize": SMALL_FONT_SIZE,
    "ytick.labelsize": SMALL_FONT_SIZE,
}
matplotlib.rcParams.update(RC_PARAMS)
# Type 42 PDFs embed a subset of each font, and fontTools logs every table it prunes at INFO (about 60 lines
# per report under Hydra's logging): not news to the reader.
logging.getLogger("fontTools").setLevel(logging.WARNING)

# config names -> the names of the paper's Appendix C table (legends, panel titles, the LaTeX table);
# Markdown tables and CSVs keep the config names, which are what a user types.
ERASER_NAMES = {
    "none": "Control",
    "leace": "LEACE",
    "qleace": "QLEACE",
    "alf_qleace": "ALF-QLEACE",
    "gradient": "Gradient Quadratic",
    "random": "Random projection",
}
# One colour per eraser in every figure (Okabe-Ito: distinct under the common colour blindnesses).
ERASER_COLORS = {
    "none": "#000000",
    "leace": "#0072B2",
    "qleace": "#D55E00",
    "alf_qleace": "#E69F00",
    "gradient": "#009E73",
    "random": "#CC79A7",
}
OTHER_COLORS = ("#56B4E9", "#F0E442", "#7F7F7F", "#8C564B", "#9467BD", "#BCBD22")  # erasers not named above
MAX_TITLE_LINES = 2
TITLE_WIDTH = 48  # characters per title line at FONT_SIZE over a panel of COLUMN_WIDTH
# Figure sizes a two-column paper takes as they are (inches): one column, or both (figure*). A figure of one panel
# is a column wide; of more, panels wrap into rows of PANELS_PER_ROW across both columns. The saved file has exactly
# this width: the legend goes below the panels, inside the figure, not beside them.
COLUMN_WIDTH = 3.5
TWO_COLUMN_WIDTH = 7.0
PANELS_PER_ROW = 2  # a panel of a two-column figure is a column wide: its labels read as in a one-panel figure
PANEL_HEIGHT = 2.4  # inches per row of panels
LEGEND_ENTRY_WIDTH = 1.75  # inches per legend column: "Gradient Quadratic" and its handle at SMALL_FONT_SIZE
LEGEND_ROW_HEIGHT = 0.17  # inches per legend row at SMALL_FONT_SIZE


def display_name(label: str) -> str:
    """``qleace (shrinkage=optimal)`` -> ``QLEACE (shrinkage=optimal)``; unknown names unchanged."""
    base, sep, rest = label.partition(" ")
    return ERASER_NAMES.get(base, base) + sep + rest


def eraser_colors(labels: Iterable[str]) -> dict[str, str]:
    """A colour per eraser label: the eraser's own for its bare name (or its first option variant, so a
    sweep of one variant keeps the usual colour), the next free one of OTHER_COLORS for anything else."""
    labels = set(labels)
    colors: dict[str, str] = {}
    spare = iter(OTHER_COLORS * (len(labels) + 1))
    ordered = sorted(labels, key=lambda label: (label.partition(" ")[0], label.partition(" ")[2] != "", label))
    for label in ordered:
        base = label.partition(" ")[0]
        own = ERASER_COLORS.get(base)
        colors[label] = own if own is not None and own not in colors.values() else next(spare)
    return colors


def panel_title(head: str, setting: str = "") -> str:
    """'mlp: width=64, depth=2' wrapped to the panel, at most MAX_TITLE_LINES lines (the rest cut with '…')."""
    lines = textwrap.wrap(f"{head}: {setting}" if setting else head, TITLE_WIDTH)
    if len(lines) > MAX_TITLE_LINES:
        lines = lines[:MAX_TITLE_LINES]
        lines[-1] = lines[-1][: TITLE_WIDTH - 1] + "…"
    return "\n".join(lines)
