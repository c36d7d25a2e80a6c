"""The report's figures: MDL against width / depth, Figure 3 (MDL increase over the control per
width), final-fit loss curves and probe curves (Figure 1, the erased images, is in figure1.py).

Everything is drawn with matplotlib's Agg backend (no display needed) in the style of
``mdl.report.style`` (fonts, sizes, the paper's eraser names, a colour per eraser), each figure as PNG
(shown in report.md) and as PDF and SVG beside it (for a paper), a column (3.5 in) or two columns (7 in) wide with
the panels wrapped into rows, one legend below the panels that keys every line colour and marker kind drawn
(hollow markers, stars), and a dotted chance line where one is defined. Each function returns the files it wrote
with a caption, plus notes on what it had to skip and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mdl.report.style import (
    COLUMN_WIDTH,
    LEGEND_ENTRY_WIDTH,
    LEGEND_ROW_HEIGHT,
    PANEL_HEIGHT,
    PANELS_PER_ROW,
    TWO_COLUMN_WIDTH,
    display_name,
    eraser_colors,
    panel_title,
)

import matplotlib.pyplot as plt  # noqa: E402  (after the style module chose the Agg backend)
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from mdl.report.sweep import Sweep, group_by, sortable  # noqa: E402
from mdl.report.stats import Cell, Increase, chance_level, curve_stats, erasers_of, mdl_increase  # noqa: E402

SCALING_METRICS = (
    ("paper_mdl", "paper MDL (bits/sample)"),
    ("online_bits_per_example", "online code length (bits/example)"),
)


@dataclass
class FigureFile:
    path: Path
    title: str
    caption: str


FORMATS = ("png", "pdf", "svg")
SEED_LINE_WIDTH = 0.7  # the loss figures' thin line of one seed, under the thick mean


def marker_key(label: str, marker: str = "o", hollow: bool = False, size: float = 5.0) -> Line2D:
    """A legend entry for a kind of marker (not a line): grey, so it keys the marker's meaning, not an eraser."""
    return Line2D(
        [],
        [],
        linestyle="none",
        marker=marker,
        markersize=size,
        markerfacecolor="white" if hollow else "grey",
        markeredgecolor="black" if marker == "*" else "grey",
        markeredgewidth=0.6,
        label=label,
    )


def line_key(label: str, linestyle: str, linewidth: float = 1.5, color: str = "grey") -> Line2D:
    """A legend entry for a kind of line (solid, dashed, dotted; thin or thick), grey unless drawn in another colour."""
    return Line2D([], [], color=color, linestyle=linestyle, linewidth=linewidth, label=label)


def figure_legend(fig, keys: list[Line2D] | tuple[Line2D, ...] = ()) -> None:
    """One legend for the whole figure, below its panels and inside its width: every labelled line of the visible
    panels once (eraser names as the paper writes them), then ``keys``, the marker and line kinds drawn. The figure
    grows in height by the legend's rows, never in width."""
    entries: dict[str, Any] = {}
    for ax in fig.axes:
        if ax.get_visible():
            for handle, label in zip(*ax.get_legend_handles_labels()):
                entries.setdefault(display_name(label), handle)
    for key in keys:
        entries.setdefault(key.get_label(), key)
    if not entries:
        return
    width = fig.get_figwidth()
    columns = max(1, min(len(entries), int(width // LEGEND_ENTRY_WIDTH)))
    fig.set_size_inches(width, fig.get_figheight() + math.ceil(len(entries) / columns) * LEGEND_ROW_HEIGHT)
    fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=columns, frameon=False)


def chance_line(ax, value: float | None) -> None:
    if value is not None:
        ax.axhline(value, color="grey", lw=0.8, ls=":", label="chance")


def cell_colors(cells: list[Cell]) -> dict[str, Any]:
    """The style's colour of each eraser of ``cells``, in the report's eraser order (the order legends list them)."""
    colors = eraser_colors(c.eraser for c in cells)
    return {e: colors[e] for e in erasers_of(cells)}


def slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text).strip("_") or "x"


def figure_width(panels_per_row: int) -> float:
    """A column for one panel per row, both columns for more."""
    return COLUMN_WIDTH if panels_per_row == 1 else TWO_COLUMN_WIDTH


def _grid(n: int, rows_per_panel: int = 1):
    """A figure of ``n`` panels (each ``rows_per_panel`` axes tall), wrapped into rows of PANELS_PER_ROW; its
    layout engine keeps labels, titles and the legend inside the figure's size."""
    cols = min(n, PANELS_PER_ROW)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(
        rows * rows_per_panel,
        cols,
        figsize=(figure_width(cols), PANEL_HEIGHT * rows * rows_per_panel),
        squeeze=False,
        layout="constrained",
    )
    return fig, axes, cols


def _save(fig, path: Path) -> Path:
    """``path`` (PNG) and the same figure as PDF and SVG beside it, each at the figure's own size (a column or two
    wide: nothing drawn outside it); returns the PNG."""
    for fmt in FORMATS:
        fig.savefig(path.with_suffix(f".{fmt}"), dpi=200)
    plt.close(fig)
    return path


# --- MDL against width and depth --------------------------------------------------------------


def scaling_figures(sweep: Sweep, cells: list[Cell], out: Path, max_seeds: int) -> tuple[list[FigureFile], list[str]]:
    """One figure per (axis, architecture) where that axis was varied; panels = the other row
    keys' values, top row paper MDL, bottom row online code length; one line per eraser."""
    figures, notes = [], []
    colors = cell_colors(cells)
    for axis in ("width", "depth"):
        if axis not in sweep.row_keys:
            notes.append(f"MDL vs {axis}: not drawn, no sweep varied `{axis}`.")
            continue
        a = sweep.row_keys.index(axis)
        for arch in sorted({c.arch for c in cells}):
            panels = group_by((c for c in cells if c.arch == arch), lambda c: c.row[:a] + c.row[a + 1 :])
            panels = {
                k: v
                for k, v in panels.items()
                if len({c.row[a] for c in v}) > 1
                and all(isinstance(c.row[a], (int, float)) and c.row[a] > 0 for c in v)
            }
            if not panels:
                notes.append(f"MDL vs {axis}: not drawn for {arch}, it has one positive numeric `{axis}` per setting.")
                continue
            fig, axes, cols = _grid(len(panels), rows_per_panel=len(SCALING_METRICS))
            for p, (other, members) in enumerate(sorted(panels.items(), key=lambda kv: sortable(kv[0]))):
                for m, (metric, ylabel) in enumerate(SCALING_METRICS):
                    ax = axes[(p // cols) * len(SCALING_METRICS) + m][p % cols]
                    _scaling_panel(ax, members, a, metric, colors, max_seeds)
                    chance_line(ax, chance_level(members, metric))
                    ax.set_xscale("log", base=2)
                    ticks = sorted({c.row[a] for c in members})
                    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
                    ax.minorticks_off()
                    ax.set(
                        xlabel=axis,
                        ylabel=ylabel,
                        title=panel_title(arch, sweep.describe(_insert(other, a, None), axis)),
                    )
            _finish_grid(axes, len(panels), cols, len(SCALING_METRICS))
            partial = any(c.n < max_seeds for cells_ in panels.values() for c in cells_ if c.n)
            figure_legend(fig, seed_keys(max_seeds) if partial else ())
            path = _save(fig, out / f"mdl_vs_{axis}_{slug(arch)}.png")
            figures.append(
                FigureFile(
                    path,
                    f"MDL vs {axis}: {arch}",
                    f"Mean ± 1 sample std (ddof=1) over seeds; log2 x axis. Hollow markers: cells with "
                    f"fewer than {max_seeds} seeds (see Coverage).",
                )
            )
    return figures, notes


def seed_keys(max_seeds: int) -> tuple[Line2D, Line2D]:
    """The key of the scaling figures' markers: filled, a cell with every seed; hollow, one with fewer."""
    return marker_key(f"{max_seeds} seeds"), marker_key(f"fewer than {max_seeds} seeds", hollow=True)


def _insert(values: tuple[Any, ...], index: int, value: Any) -> tuple[Any, ...]:
    return values[:index] + (value,) + values[index:]


def _scaling_panel(ax, members: list[Cell], a: int, metric: str, colors: dict, max_seeds: int) -> None:
    for eraser in sorted({c.eraser for c in members}, key=lambda e: list(colors).index(e)):
        pts = sorted((c.row[a], *c.mean_std(metric)) for c in members if c.eraser == eraser)
        pts = [p for p in pts if p[3] > 0]
        if not pts:
            continue
        x, mean, std, n = (np.array(v, dtype=float) for v in zip(*pts))
        ax.errorbar(x, mean, yerr=np.nan_to_num(std), color=colors[eraser], label=eraser, capsize=3, marker="none")
        full = n >= max_seeds
        ax.scatter(x[full], mean[full], color=colors[eraser], zorder=3)
        ax.scatter(x[~full], mean[~full], facecolors="white", edgecolors=colors[eraser], zorder=3)


def _finish_grid(axes, used: int, cols: int, rows_per_panel: int = 1) -> None:
    """Hide the grid's unused axes and give the panels one y scale per metric row: the panels of a
    figure compare the same quantity across settings, which different scales would hide."""
    total = (len(axes) // rows_per_panel) * cols
    for p in range(used, total):
        for m in range(rows_per_panel):
            axes[(p // cols) * rows_per_panel + m][p % cols].set_visible(False)
    for m in range(rows_per_panel):
        share_y([axes[(p // cols) * rows_per_panel + m][p % cols] for p in range(used)])


def share_y(axes: list) -> None:
    """The same y limits on every axis of ``axes``: the union of their own."""
    if len(axes) < 2:
        return
    limits = [ax.get_ylim() for ax in axes]
    low, high = min(lo for lo, _ in limits), max(hi for _, hi in limits)
    for ax in axes:
        ax.set_ylim(low, high)


# --- Figure 3: MDL increase over the control, per width ---------------------------------------

FIGURE3_NAME = "figure3_mdl_increase.png"


def figure3_panels(sweep: Sweep, cells: list[Cell], metric: str = "paper_mdl") -> dict[tuple[str, str], list[Increase]]:
    """The points of Figure 3 grouped into panels: (architecture, other row keys) -> increases."""
    return group_by(mdl_increase(sweep, cells, metric), lambda inc: (inc.arch, sweep.describe(inc.row, "width")))


def figure3(
    sweep: Sweep, cells: list[Cell], out: Path, metric: str = "paper_mdl"
) -> tuple[list[FigureFile], list[str]]:
    """The paper's Figure 3: per architecture (and setting of the other row keys), the increase of
    the mean MDL over the control's at each width, one line per eraser (data in mdl_increase.csv)."""
    panels = figure3_panels(sweep, cells, metric)
    if not panels:
        return [], ["Figure 3 (MDL increase over the control): not drawn, no erased cell has a control in its row."]
    colors = cell_colors(cells)
    fig, axes, cols = _grid(len(panels))
    for p, ((arch, setting), points) in enumerate(sorted(panels.items())):
        ax = axes[p // cols][p % cols]
        for eraser in sorted({i.eraser for i in points}, key=lambda e: list(colors).index(e)):
            pts = sorted((i for i in points if i.eraser == eraser), key=lambda i: i.width)
            x = np.array([i.width for i in pts])
            y = np.array([i.increase for i in pts])
            ax.errorbar(
                x, y, yerr=np.nan_to_num([i.se for i in pts]), color=colors[eraser], label=eraser, capsize=3, marker="o"
            )
        ax.axhline(0.0, color="black", lw=0.8, ls="--")
        widths = sorted({i.width for i in points})
        if len(widths) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [f"{w:g}" for w in widths])
        ax.minorticks_off()
        ax.set(
            xlabel="width",
            ylabel="MDL increase over control (bits/sample)" if metric == "paper_mdl" else f"{metric} increase",
            title=panel_title(arch, setting),
        )
    _finish_grid(axes, len(panels), cols)
    figure_legend(fig, [line_key("no change", "--", 0.8, "black")])
    path = _save(fig, out / FIGURE3_NAME)
    return [
        FigureFile(
            path,
            "Figure 3: MDL increase over the control, per width",
            "The paper's Figure 3: mean paper MDL of each erased cell minus the mean of the control in the same "
            "row (same architecture, width and other settings); error bars ± the standard error of that "
            "difference, √(sd_e²/n_e + sd_c²/n_c) (none when a cell has one seed); dashed: no change. Numbers "
            "in `mdl_increase.csv`.",
        )
    ], []


# --- validation loss of the final fit ---------------------------------------------------------


def loss_figures(sweep: Sweep, cells: list[Cell], out: Path) -> tuple[list[FigureFile], list[str]]:
    """Per architecture: one panel per row, one curve per eraser (mean over seeds, ± std band)."""
    figures, notes = [], []
    colors = cell_colors(cells)
    for arch in sorted({c.arch for c in cells}):
        rows = group_by((c for c in cells if c.arch == arch), lambda c: c.row)
        fig, axes, cols = _grid(len(rows))
        drawn = 0
        for p, (row, members) in enumerate(sorted(rows.items(), key=lambda kv: sortable(kv[0]))):
            ax = axes[p // cols][p % cols]
            for c in sorted(members, key=lambda c: list(colors).index(c.eraser)):
                stats = curve_stats(c)
                if stats is None:
                    notes.append(f"{arch} {sweep.describe(row)} {c.eraser}: no val_loss_curve in any run.")
                    continue
                for r in c.runs:
                    curve = r.results.get("val_loss_curve") or []
                    ax.plot(np.arange(1, len(curve) + 1), curve, color=colors[c.eraser], alpha=0.25, lw=SEED_LINE_WIDTH)
                epochs = np.arange(1, len(stats.mean) + 1)
                ax.plot(epochs, stats.mean, color=colors[c.eraser], lw=2, label=c.eraser)
                if stats.n_seeds > 1:
                    ax.fill_between(
                        epochs, stats.mean - stats.std, stats.mean + stats.std, color=colors[c.eraser], alpha=0.2
                    )
                drawn += 1
            chance_line(ax, chance_level(members, "val_loss"))
            ax.set(
                title=panel_title(arch, sweep.describe(row)),
                xlabel="epoch of the final full-data fit",
                ylabel="validation loss (nats)",
            )
        _finish_grid(axes, len(rows), cols)
        figure_legend(fig, [line_key("mean over seeds", "-", 2.0), line_key("one seed", "-", SEED_LINE_WIDTH)])
        if not drawn:
            plt.close(fig)
            continue
        path = _save(fig, out / f"val_loss_{slug(arch)}.png")
        figures.append(
            FigureFile(
                path,
                f"Validation loss of the final fit: {arch}",
                "Thick line: mean over seeds on the epochs every seed reached; band: ± 1 sample std "
                "(ddof=1); thin lines: individual seeds over their full length (early stopping makes "
                "lengths differ).",
            )
        )
    return figures, notes


# --- max-ent probes: probe accuracy against real validation accuracy --------------------------

PROBE_KEY, VAL_ACCURACY_KEY = "maxent_probe_accuracy_curve", "val_accuracy_curve"


def probe_figures(sweep: Sweep, cells: list[Cell], out: Path) -> tuple[list[FigureFile], list[str]]:
    """Per architecture whose runs have max-ent probe curves (probes=maxent): one panel per row, per
    eraser the mean over seeds of the real validation accuracy (solid) and of the probe accuracy
    (dashed) over the epochs of the final fit, and chance (1/K, dotted)."""
    figures, notes = [], []
    with_probes = [c for c in cells if any(isinstance(r.results.get(PROBE_KEY), list) for r in c.runs)]
    colors = cell_colors(cells)
    for arch in sorted({c.arch for c in with_probes}):
        rows = group_by((c for c in with_probes if c.arch == arch), lambda c: c.row)
        fig, axes, cols = _grid(len(rows))
        for p, (row, members) in enumerate(sorted(rows.items(), key=lambda kv: sortable(kv[0]))):
            ax = axes[p // cols][p % cols]
            chance = set()
            for c in sorted(members, key=lambda c: list(colors).index(c.eraser)):
                val, probe = curve_stats(c, VAL_ACCURACY_KEY), curve_stats(c, PROBE_KEY)
                if val is None or probe is None:
                    notes.append(f"{arch} {sweep.describe(row)} {c.eraser}: no {VAL_ACCURACY_KEY} / {PROBE_KEY}.")
                    continue
                missing = sum(not isinstance(r.results.get(PROBE_KEY), list) for r in c.runs)
                if missing:
                    notes.append(
                        f"{arch} {sweep.describe(row)} {c.eraser}: {missing} of {c.n} runs without probes "
                        f"(probes=maxent); the probe figure averages the others."
                    )
                ax.plot(np.arange(1, len(val.mean) + 1), val.mean, color=colors[c.eraser], lw=2, label=c.eraser)
                ax.plot(np.arange(1, len(probe.mean) + 1), probe.mean, color=colors[c.eraser], lw=2, ls="--")
                chance |= {1 / r.results["num_classes"] for r in c.runs if r.results.get("num_classes")}
            for level in sorted(chance):
                ax.axhline(level, color="gray", ls=":", lw=1)
            ax.set(
                title=panel_title(arch, sweep.describe(row)),
                xlabel="epoch of the final full-data fit",
                ylabel="accuracy",
            )
        _finish_grid(axes, len(rows), cols)
        figure_legend(
            fig, [line_key("validation", "-"), line_key("max-ent probes", "--"), line_key("chance, 1/K", ":")]
        )
        path = _save(fig, out / f"maxent_probes_{slug(arch)}.png")
        figures.append(
            FigureFile(
                path,
                f"Max-ent probes over the final fit: {arch}",
                "Accuracy on the real validation split (solid) and on the max-ent probes (dashed: "
                "samples of Gaussians with each class's mean and covariance of the erased training "
                "split), mean over seeds on the epochs every seed reached; dotted: chance, 1/K. A "
                "dashed line close to the solid one: what the network uses so far is in the class "
                "means and covariances.",
            )
        )
    return figures, notes
