"""The learning-rate search's answer: per architecture, other settings and eraser, the swept
``optimizer.lr`` with the lowest mean paper MDL, and whether it lies at the edge of the grid (then
the grid should be extended). Written into report.md when a sweep varies ``optimizer.lr``
(``+experiment=lr_search``). muP's premise is that an lr tuned at the base width transfers to every
width (Yang et al. 2021, Tensor Programs V), so the search runs at ``model.base_width``.

The figure ``lr_<arch>.png`` draws paper MDL against lr, a line per eraser. Runs whose fits stopped at
``trainer.kwargs.max_epochs`` (``mdl.results.capped_fits``) are under-trained, which makes small lrs look
worse than they are: their lrs are drawn hollow, counted in the table and named in the text."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mdl.report.figures import FigureFile, _finish_grid, _grid, _save, cell_colors, figure_legend, marker_key, plt, slug
from mdl.report.style import display_name, panel_title
from mdl.report.sweep import Sweep, eraser_sort_key, group_by, sortable
from mdl.results import capped_fits, recorded_epoch_cap
from mdl.report.stats import Cell

LR_KEY = "optimizer.lr"
LR_AXIS_LABEL = f"learning rate ({LR_KEY})"
# A best lr needs a minimum with a neighbour on either side to be one: one point is no search at all (a folder
# of runs whose lr differs between architectures), two points only say which end is lower.
MIN_GRID_POINTS = 3
GRID_WORDS = {1: "one point", 2: "two points"}
NO_BEST_LR = (
    f"No cell tried {MIN_GRID_POINTS} or more values of `{LR_KEY}`, so no best lr is named and none is written for "
    "a sweep to use."
)


def grid_words(points: int) -> str:
    """'one point' / 'two points': why a grid this small names no best lr."""
    return GRID_WORDS.get(points, f"{points} points")


@dataclass(frozen=True)
class LrChoice:
    arch: str
    setting: str  # the other row keys, described
    eraser: str
    lr: float
    mean: float
    n: int
    grid: tuple[float, ...]
    names: tuple[str, str, str] = (
        "",
        "",
        "",
    )  # data.source, model.name, eraser.name of its runs: where a sweep looks it up
    capped: int = 0  # runs at the best lr with a fit stopped at trainer.kwargs.max_epochs

    @property
    def named(self) -> bool:
        """Whether the grid is large enough (MIN_GRID_POINTS) for its lowest point to be called the best lr."""
        return len(self.grid) >= MIN_GRID_POINTS

    @property
    def at_edge(self) -> bool:
        return self.named and self.lr in (self.grid[0], self.grid[-1])


@dataclass(frozen=True)
class LrPoint:
    """One swept lr of one (architecture, setting, eraser): its cell's mean metric, and how many of its runs
    had a fit stopped at trainer.kwargs.max_epochs (capped: under-trained, so their MDL reads too long)."""

    arch: str
    setting: str
    eraser: str
    lr: float
    mean: float
    std: float
    n: int
    capped: int
    cell: Cell
    other: tuple[Any, ...]  # the cell's row with the lr left out: the panel it is drawn in

    @property
    def key(self) -> tuple[str, str, str]:
        return self.arch, self.setting, self.eraser


def lr_points(sweep: Sweep, cells: list[Cell], metric: str = "paper_mdl") -> list[LrPoint]:
    """Every cell with a numeric ``optimizer.lr`` and a mean ``metric``, as a point of the lr search."""
    if LR_KEY not in sweep.row_keys:
        return []
    i = sweep.row_keys.index(LR_KEY)
    points = []
    for c in cells:
        mean, std, n = c.mean_std(metric)
        if n and isinstance(c.row[i], (int, float)) and not math.isnan(mean):
            other = c.row[:i] + (None,) + c.row[i + 1 :]
            points.append(
                LrPoint(
                    c.arch,
                    sweep.describe(other, LR_KEY),
                    c.eraser,
                    float(c.row[i]),
                    mean,
                    std,
                    n,
                    sum(bool(capped_fits(r.results)) for r in c.runs),
                    c,
                    other,
                )
            )
    return points


def best_learning_rates(sweep: Sweep, cells: list[Cell], metric: str = "paper_mdl") -> list[LrChoice]:
    """Per architecture, other settings and eraser, the swept lr with the lowest mean ``metric``, with
    every lr tried (to tell whether the best lies at the grid's edge) and the data, model and eraser names that
    key the config a later sweep composes (``write_best_lrs``)."""
    choices = []
    for (arch, setting, eraser), points in sorted(group_by(lr_points(sweep, cells, metric), lambda p: p.key).items()):
        best = min(points, key=lambda p: p.mean)
        config = best.cell.runs[0].results.get("config", {})
        names = tuple(
            str((config.get(k) or {}).get(f, ""))
            for k, f in (("data", "source"), ("model", "name"), ("eraser", "name"))
        )
        choices.append(
            LrChoice(
                arch,
                setting,
                eraser,
                best.lr,
                best.mean,
                best.n,
                tuple(sorted(p.lr for p in points)),
                names,
                best.capped,
            )
        )
    return choices


LR_CONFIG = ("lr", "best")  # <report>/lr/best.yaml: a config group option a sweep adds with +lr=best


def write_best_lrs(choices: list[LrChoice], report_dir: Path) -> tuple[Path | None, str]:
    """The search's answers as a Hydra config a sweep composes, and the words saying how (or why there is none):
    ``lr_search.<data>.<model>.<eraser>: lr``, with ``optimizer.lr`` looked up from it (null, hence an error naming
    optimizer.lr, for a data set, model or eraser the search did not cover)."""
    found: dict[str, dict[str, dict[str, float]]] = {}
    choices = [c for c in choices if c.named]
    if not choices:
        return None, NO_BEST_LR
    for c in choices:
        data, model, eraser = c.names
        slot = found.setdefault(data, {}).setdefault(model, {})
        if not all(c.names) or eraser in slot:
            return None, (
                "The search varied more than the learning rate per data set, model and eraser "
                f"({c.arch}, {c.setting or '-'}, {c.eraser}): pick from the table."
            )
        slot[eraser] = c.lr
    from omegaconf import OmegaConf

    from erasure.files import atomic_write_bytes

    path = report_dir / LR_CONFIG[0] / f"{LR_CONFIG[1]}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = OmegaConf.to_yaml(
        OmegaConf.create(
            {
                "lr_search": found,
                "optimizer": {"lr": "${oc.select:lr_search.${data.source}.${model.name}.${eraser.name},null}"},
            }
        )
    )
    atomic_write_bytes(
        path,
        (
            "# @package _global_\n# The best learning rates of an lr search at the muP base width "
            "(mdl.report.lr).\n" + body
        ).encode(),
    )  # read by later sweeps: never half written
    use = (
        f'Use them in a sweep: `python launch.py -m "hydra.searchpath=[file://{report_dir.resolve()}]" '
        f"+{LR_CONFIG[0]}={LR_CONFIG[1]} ...` (`{path.name}` in `{path.parent}` sets `optimizer.lr` per data set, "
        "model and eraser; at any width, as muP transfers it)."
    )
    return path, use


def lr_section(sweep: Sweep, cells: list[Cell], report_dir: Path | None = None) -> list[str]:
    """report.md's "Learning rate" section; with ``report_dir``, the answers also written for a sweep to use. A cell
    whose grid has fewer than MIN_GRID_POINTS lrs is listed as "one point" / "two points", with no best lr."""
    choices = best_learning_rates(sweep, cells)
    if not choices:
        return []
    use = "Use it with `optimizer.lr=<value>` in the real sweep."
    if not any(c.named for c in choices):
        use = NO_BEST_LR
    elif report_dir is not None:
        use = write_best_lrs(choices, report_dir)[1]
    points = lr_points(sweep, cells)
    small = [c for c in choices if not c.named]
    md = [
        "## Learning rate\n",
        f"The swept `{LR_KEY}` with the lowest mean paper MDL, per architecture, setting and eraser, where it tried at "
        f"least {MIN_GRID_POINTS} values (muP: tuned at the base width, it transfers to the others; figure "
        f"`lr_<arch>.png`). {use}\n",
    ]
    if small:
        counts = ", ".join(
            f"{n} with {grid_words(k)}"
            for k in sorted({len(c.grid) for c in small})
            for n in [sum(len(c.grid) == k for c in small)]
        )
        md.append(
            f"{len(small)} of {len(choices)} cells tried fewer than {MIN_GRID_POINTS} values of `{LR_KEY}` ({counts}): "
            "no best lr is named for them (one point is no search; two only say which end is lower).\n"
        )
    md += [
        "| architecture | setting | eraser | best lr | paper MDL | n | grid | capped runs (lr: runs with a fit at "
        "max_epochs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in choices:
        mine = sorted((p for p in points if p.key == (c.arch, c.setting, c.eraser)), key=lambda p: p.lr)
        by_lr = ", ".join(f"{p.lr:g}: {p.capped}/{p.n}" for p in mine if p.capped) or "none"
        grid = ", ".join(f"{g:g}" for g in c.grid)
        if not c.named:
            mdl = ", ".join(f"{p.mean:.4f}" for p in mine)
            md.append(
                f"| {c.arch} | {c.setting or '-'} | {c.eraser} | {grid_words(len(c.grid))} | {mdl} | "
                f"{sum(p.n for p in mine)} | {grid} | {by_lr} |"
            )
            continue
        edge = " (at the edge of the grid: extend it)" if c.at_edge else ""
        capped = f" (**capped**: {c.capped} of {c.n} runs)" if c.capped else ""
        md.append(
            f"| {c.arch} | {c.setting or '-'} | {c.eraser} | {c.lr:g}{edge}{capped} | {c.mean:.4f} | {c.n} | "
            f"{grid} | {by_lr} |"
        )
    return [*md, "", *capped_lines(points), *transfer_section(sweep, cells)]


def capped_lines(points: list[LrPoint]) -> list[str]:
    """The lrs whose runs hit the epoch cap, in words: their MDL is an under-trained model's, which favours
    the lrs that converge within the cap (usually the larger ones)."""
    capped = [p for p in points if p.capped]
    if not capped:
        return []
    by_lr = group_by(points, lambda p: p.lr)
    caps = sorted(
        {
            cap
            for p in capped
            for r in p.cell.runs
            if capped_fits(r.results)
            for cap in [recorded_epoch_cap(r.results)]
            if cap is not None
        }
    )
    parts = [
        f"{lr:g}: {sum(p.capped for p in ps)} of {sum(p.n for p in ps)} runs"
        for lr, ps in sorted(by_lr.items())
        if any(p.capped for p in ps)
    ]
    return [
        f"**Capped fits** — some fits stopped at `trainer.kwargs.max_epochs` = {', '.join(map(str, caps))} before "
        f"early stopping ended them, at lr {'; '.join(parts)}. Those models may still have been improving: their "
        "MDL is too long, and the search is biased towards the lrs that converge within the cap. Raise "
        "`trainer.kwargs.max_epochs` (or -1: until early stopping) and run them again before trusting the answer.",
        "",
    ]


def lr_figures(
    sweep: Sweep, cells: list[Cell], out: Path, metric: str = "paper_mdl"
) -> tuple[list[FigureFile], list[str]]:
    """Per architecture, a panel per setting: mean ``metric`` against lr, one line per eraser, each eraser's best lr
    starred and lrs with capped runs drawn hollow."""
    points = lr_points(sweep, cells, metric)
    figures = []
    for arch in sorted({p.arch for p in points}):
        panels = group_by((p for p in points if p.arch == arch), lambda p: p.other)
        fig, axes, cols = _grid(len(panels))
        colors = cell_colors(cells)
        keys: set[str] = set()
        for k, (_, members) in enumerate(sorted(panels.items(), key=lambda kv: sortable(kv[0]))):
            keys |= _lr_panel(axes[k // cols][k % cols], members, colors)
            axes[k // cols][k % cols].set_title(panel_title(arch, members[0].setting))
        _finish_grid(axes, len(panels), cols)
        figure_legend(fig, [key for name, key in lr_keys().items() if name in keys])
        path = _save(fig, out / f"lr_{slug(arch)}.png")
        figures.append(
            FigureFile(
                path,
                f"Learning-rate search: {arch}",
                "Mean paper MDL against the learning rate, one line per eraser (error bars: sample sd "
                f"over seeds); a star marks each eraser's best lr (where it tried {MIN_GRID_POINTS}+ lrs); hollow "
                "markers: lrs where some runs "
                "had a fit stopped at `trainer.kwargs.max_epochs` (under-trained: MDL too long).",
            )
        )
    return figures, []


def lr_keys() -> dict[str, Any]:
    """The lr figures' marker kinds, by name, as legend entries."""
    return {
        "best": marker_key(f"best lr ({MIN_GRID_POINTS}+ lrs tried)", marker="*", size=9),
        "capped": marker_key("capped fits (under-trained)", hollow=True),
    }


def _lr_panel(ax, points: list[LrPoint], colors: dict[str, Any]) -> set[str]:
    """One line per eraser over the lr grid (log x), its best lr starred where the grid names one, capped lrs hollow;
    returns the marker kinds it drew (keys of ``lr_keys``)."""
    drawn = set()
    for eraser in [e for e in colors if any(p.eraser == e for p in points)]:
        pts = sorted((p for p in points if p.eraser == eraser), key=lambda p: p.lr)
        lr = [p.lr for p in pts]
        mean = [p.mean for p in pts]
        ax.errorbar(
            lr,
            mean,
            yerr=[0.0 if math.isnan(p.std) else p.std for p in pts],
            color=colors[eraser],
            label=eraser,
            capsize=2,
            marker="none",
        )
        for p in pts:
            ax.scatter(
                [p.lr],
                [p.mean],
                color=colors[eraser] if not p.capped else "white",
                edgecolors=colors[eraser],
                zorder=3,
                s=18,
            )
        if len(pts) >= MIN_GRID_POINTS:
            best = min(pts, key=lambda p: p.mean)
            ax.scatter(
                [best.lr],
                [best.mean],
                marker="*",
                s=90,
                color=colors[eraser],
                edgecolors="black",
                linewidths=0.4,
                zorder=4,
            )
            drawn.add("best")
    if any(p.capped for p in points):
        drawn.add("capped")
    ax.set(xscale="log", xlabel=LR_AXIS_LABEL, ylabel="paper MDL (bits/sample)")
    return drawn


# --- does the optimum transfer across widths? ----------------------------------------------------


def lr_grids_by_width(
    sweep: Sweep, cells: list[Cell], metric: str = "paper_mdl"
) -> dict[tuple[str, str, str], dict[Any, dict[float, float]]]:
    """(architecture, other settings, eraser) -> {width: {lr: mean ``metric``}}, when a sweep varied both
    ``optimizer.lr`` and ``width``."""
    grids: dict[tuple[str, str, str], dict[Any, dict[float, float]]] = {}
    for key, width, p in _lr_points(sweep, cells, metric):
        grids.setdefault(key, {}).setdefault(width, {})[p.lr] = p.mean
    return {k: dict(sorted(v.items())) for k, v in sorted(grids.items())}


def best_lr_by_width(
    sweep: Sweep, cells: list[Cell], metric: str = "paper_mdl"
) -> dict[tuple[str, str, str], dict[Any, float]]:
    """(architecture, other settings, eraser) -> {width: the lr with the lowest mean ``metric``}, for the widths
    whose grid has at least MIN_GRID_POINTS lrs (a group with none is left out)."""
    best = {
        key: {w: min(grid, key=grid.__getitem__) for w, grid in by_width.items() if len(grid) >= MIN_GRID_POINTS}
        for key, by_width in lr_grids_by_width(sweep, cells, metric).items()
    }
    return {k: v for k, v in best.items() if v}


def _lr_points(sweep: Sweep, cells: list[Cell], metric: str) -> list[tuple[tuple[str, str, str], Any, LrPoint]]:
    """(group key without lr and width, width, point) for every lr point (``lr_points``) with a numeric width."""
    if "width" not in sweep.row_keys:
        return []
    w = sweep.row_keys.index("width")
    return [
        ((p.arch, sweep.describe(p.other, LR_KEY, "width"), p.eraser), p.other[w], p)
        for p in lr_points(sweep, cells, metric)
        if isinstance(p.other[w], (int, float))
    ]


def transfer_section(sweep: Sweep, cells: list[Cell]) -> list[str]:
    """The best lr at each width, and whether it is the same at every width (muP's promise): judged only from the
    widths whose grid names a best lr (MIN_GRID_POINTS), "n/a" where fewer than two widths do."""
    grids = lr_grids_by_width(sweep, cells)
    if not grids:
        return []
    best = best_lr_by_width(sweep, cells)
    md = [
        "### Does the optimum transfer across widths?\n",
        "The lr with the lowest mean paper MDL at each width (figure `lr_transfer_<arch>.png`), where that width tried "
        f"at least {MIN_GRID_POINTS} lrs. Under muP it should be the same at every width.\n",
        "| architecture | setting | eraser | best lr by width | transfers |",
        "|---|---|---|---|---|",
    ]
    for key, by_width in grids.items():
        arch, setting, eraser = key
        named = best.get(key, {})
        parts = ", ".join(
            f"{w}: {named[w]:g}" if w in named else f"{w}: {grid_words(len(grid))}" for w, grid in by_width.items()
        )
        if len(named) < 2:
            verdict = f"n/a ({len(named)} of {len(by_width)} widths tried {MIN_GRID_POINTS}+ lrs)"
        else:
            verdict = "yes" if len(set(named.values())) == 1 else "no"
            if len(named) < len(by_width):
                verdict += f" (from {len(named)} of {len(by_width)} widths)"
        md.append(f"| {arch} | {setting or '-'} | {eraser} | {parts} | {verdict} |")
    return [*md, ""]


def lr_transfer_figures(
    sweep: Sweep, cells: list[Cell], out: Path, metric: str = "paper_mdl"
) -> tuple[list[FigureFile], list[str]]:
    """Per architecture, panels per (setting, eraser): mean ``metric`` against lr, one line per width, each
    width's best lr marked with a star."""
    series: dict[str, dict[tuple[str, str], dict[Any, list[tuple[float, float, float]]]]] = {}
    for (arch, setting, eraser), width, p in _lr_points(sweep, cells, metric):
        series.setdefault(arch, {}).setdefault((setting, eraser), {}).setdefault(width, []).append(
            (p.lr, p.mean, p.std)
        )
    figures = []
    for arch, panels in sorted(series.items()):
        fig, axes, cols = _grid(len(panels))
        widths = sorted({w for lines in panels.values() for w in lines})
        colors = {w: plt.cm.viridis(k / max(len(widths) - 1, 1)) for k, w in enumerate(widths)}
        ordered = sorted(panels.items(), key=lambda kv: (kv[0][0], eraser_sort_key(kv[0][1])))
        starred = False
        for p, ((setting, eraser), lines) in enumerate(ordered):
            ax = axes[p // cols][p % cols]
            for width, pts in sorted(lines.items()):
                lr, mean, std = zip(*sorted(pts))
                ax.errorbar(
                    lr,
                    mean,
                    yerr=[0.0 if math.isnan(v) else v for v in std],
                    color=colors[width],
                    label=f"width {width}",
                    capsize=2,
                    marker="o",
                    markersize=3,
                )
                if len(lr) >= MIN_GRID_POINTS:
                    k = min(range(len(mean)), key=mean.__getitem__)
                    ax.scatter(
                        [lr[k]], [mean[k]], marker="*", s=80, color=colors[width], edgecolors="black", linewidths=0.4
                    )
                    starred = True
            ax.set(
                xscale="log",
                xlabel=LR_AXIS_LABEL,
                ylabel="paper MDL (bits/sample)",
                title=panel_title(arch, ", ".join(x for x in (setting, display_name(eraser)) if x)),
            )
        _finish_grid(axes, len(panels), cols)
        figure_legend(fig, [lr_keys()["best"]] if starred else [])
        path = _save(fig, out / f"lr_transfer_{slug(arch)}.png")
        figures.append(
            FigureFile(
                path,
                f"Learning rate across widths: {arch}",
                "Mean paper MDL against the learning rate, one line per width (error bars: sample sd "
                "over seeds); a star marks each width's best lr. Under muP the stars line up.",
            )
        )
    return figures, []
