"""Figure 1 of the report: the same images under each eraser of a sweep (one column per eraser)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mdl.report.figures import FigureFile, _save, plt, slug
from mdl.report.style import COLUMN_WIDTH, FONT_SIZE, TWO_COLUMN_WIDTH, display_name, eraser_colors
from mdl.report.sweep import CONTROL, Run, Sweep, eraser_sort_key, group_by, load_sweep

RANDOM_FIT_IMAGES = 8192
MIN_IMAGE_SIZE = 1.0  # inches: an image narrower than this reads as a thumbnail; more columns go two columns wide
TITLE_HEIGHT = 0.35  # inches above the images for a column title of two lines at FONT_SIZE
CHARS_PER_INCH = 72 / (0.6 * FONT_SIZE)  # a title's characters per inch at FONT_SIZE (average glyph 0.6 em)

ImageLoader = Callable[[dict[str, Any]], tuple[Any, Any]]
"""config of a run -> (images float (n, c, h, w), int64 labels (n,)) of its data source."""


def default_image_loader(config: dict[str, Any]) -> tuple[Any, Any]:
    """Training images of the run's data source through ``datamodules.load_source``."""
    from datamodules import load_source

    data = dict(config.get("data") or {})
    name = data.pop("source", None) or data.pop("name", None)
    if name is None:
        raise ValueError("config.data has no `source` key naming the data set")
    options = data.get("options") if isinstance(data.get("options"), dict) else {}
    source = load_source(name, **options)
    return source.train.x, source.train.y


def edit_rank(eraser: Any) -> int | None:
    """Number of directions an eraser edits as its metadata records it (datamodules.erasure_checks); None when it
    records none."""
    from datamodules.erasure_checks import edit_rank as recorded_rank

    try:
        return recorded_rank(eraser)
    except ValueError:
        return None


def random_control(x, y, shown, rank: int):
    """The paper's equal-rank control: erasure's ``random`` eraser (``rank`` random directions
    through the data mean removed), fitted on (a sample of) the image set, applied to the shown ones."""
    from erasure import fit_eraser

    x, y = x[:RANDOM_FIT_IMAGES], y[:RANDOM_FIT_IMAGES]  # only the mean is fitted: a sample is plenty
    return fit_eraser("random", x.double(), y.long(), rank=rank, seed=0)(shown.double()).to(shown.dtype)


def pick_images(y, n_images: int) -> list[int]:
    """The first example of each of the first ``n_images`` classes (deterministic, varied)."""
    firsts: dict[int, int] = {}
    for i, label in enumerate(y.tolist()):
        firsts.setdefault(int(label), i)
    return [firsts[c] for c in sorted(firsts)[:n_images]]


def figure1(
    sweep: Sweep, out: Path, image_loader: ImageLoader | None = default_image_loader, n_images: int = 4
) -> tuple[list[FigureFile], list[str]]:
    """For each data configuration: images (rows) as given and under every fitted eraser."""
    figures, notes = [], []
    if image_loader is None or n_images < 1:
        return [], ["Figure 1: skipped (no image loader, or zero images asked for)."]
    groups = group_by(  # the images depend on the source and its options only
        sweep.runs,
        lambda r: tuple(sorted((k, v) for k, v in r.flat.items() if k.startswith(("data.source", "data.options")))),
    )
    used_names: set[str] = set()
    for g, runs in enumerate(groups.values()):
        source = (runs[0].results["config"].get("data") or {}).get("source", f"data{g}")
        try:
            x, y = image_loader(runs[0].results["config"])
        except Exception as err:  # noqa: BLE001 - any loader failure only skips the figure
            notes.append(f"Figure 1 ({source}): skipped, the images could not be loaded ({type(err).__name__}: {err}).")
            continue
        idx = pick_images(y, n_images)
        xs, ys = x[idx].float(), y[idx].long()
        columns, ranks = [("original", xs)], {}
        # The control's "erased" images are the originals: its column would repeat the first one.
        for eraser_label in sorted({r.eraser for r in runs if r.eraser != CONTROL}, key=eraser_sort_key):
            image, rank, note = _apply_first_loadable([r for r in runs if r.eraser == eraser_label], xs, ys)
            if note:
                notes.append(f"Figure 1 ({source}), {eraser_label}: {note}")
            if image is not None:
                columns.append((eraser_label, image))
                ranks[eraser_label] = rank
        if len(columns) == 1:
            notes.append(f"Figure 1 ({source}): skipped, no eraser of this data set could be applied.")
            continue
        caption_rank = ""
        if not any(label.startswith("random") for label, _ in columns):  # else the sweep has its own
            rank, origin = _reference_rank(ranks)
            try:
                if not rank:
                    raise ValueError("no eraser records its edit rank")
                columns.append((f"random (rank {rank})", random_control(x, y, xs, rank)))
                caption_rank = f" The last column removes {rank} random directions (edit rank of {origin})."
            except Exception as err:  # noqa: BLE001 - the control column is optional
                notes.append(f"Figure 1 ({source}): no random-projection column ({type(err).__name__}: {err}).")
        base = f"figure1_{slug(str(source))}"
        name = base if base not in used_names else f"{base}_{g}"
        used_names.add(name)
        path = _draw_figure1(columns, out / f"{name}.png", float(x.min()), float(x.max()))
        figures.append(
            FigureFile(
                path,
                f"Figure 1: {source} images under each eraser",
                "Rows: the first example of each of the first classes of the training set; columns: "
                "unedited (= the control) and under each fitted eraser (label-dependent erasers get the true label). "
                f"Pixels clipped to the data range for display.{caption_rank}",
            )
        )
    return figures, notes


def _reference_rank(ranks: dict[str, int | None]) -> tuple[int | None, str]:
    for label, rank in ranks.items():
        if label.startswith("alf_qleace") and rank:
            return rank, label
    known = [(r, label) for label, r in ranks.items() if r]
    return max(known) if known else (None, "")


def _apply_first_loadable(runs: list[Run], xs, ys):
    """Apply the eraser of the first run whose file loads; (images, edit rank, note)."""
    from erasure import load_eraser

    reasons = []
    for run in sorted(runs, key=lambda r: str(r.replicate)):
        raw = run.results.get("eraser_path")
        if not raw:
            reasons.append("eraser_path is null (the run saved no eraser, e.g. one that cannot transform new data)")
            continue
        path = Path(raw)
        if not path.exists() and (run.path.parent / path.name).exists():
            path = run.path.parent / path.name  # the sweep was moved: look next to results.json
        try:
            eraser = load_eraser(path)
            out = eraser(xs, ys) if getattr(eraser, "requires_labels", False) else eraser(xs)
            return out, edit_rank(eraser), None
        except Exception as err:  # noqa: BLE001 - report and try the next seed's file
            reasons.append(f"{path}: {type(err).__name__}: {err}")
    return None, None, "not shown; " + "; ".join(dict.fromkeys(reasons))


def _draw_figure1(columns: list[tuple[str, Any]], path: Path, lo: float, hi: float) -> Path:
    """A column wide while every image is at least MIN_IMAGE_SIZE across, else two columns; titles wrapped to their
    image's width. The column titles, in each eraser's colour, are the figure's key."""
    n_rows, n_cols = columns[0][1].shape[0], len(columns)
    width = COLUMN_WIDTH if COLUMN_WIDTH / n_cols >= MIN_IMAGE_SIZE else TWO_COLUMN_WIDTH
    side = width / n_cols
    fig, axes = plt.subplots(
        n_rows, n_cols, figsize=(width, side * n_rows + TITLE_HEIGHT), squeeze=False, layout="constrained"
    )
    span = hi - lo if hi > lo else 1.0
    colors = eraser_colors(label for label, _ in columns[1:])  # the original's column has no eraser
    for j, (label, images) in enumerate(columns):
        for i in range(n_rows):
            img = ((images[i].detach().double().cpu().numpy() - lo) / span).clip(0, 1)
            ax = axes[i][j]
            if img.shape[0] == 1:
                ax.imshow(img[0], cmap="gray", vmin=0, vmax=1)
            else:
                ax.imshow(np.moveaxis(img[:3], 0, -1))
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                title = textwrap.fill(display_name(label), max(6, int(side * CHARS_PER_INCH)))
                ax.set_title(title, color=colors.get(label, "black"))
    return _save(fig, path)


def run_panel(run_dir: Path) -> list[tuple[Path, str]]:
    """One run's panel of Figure 1 (a few training images as given, under the run's fitted eraser and under a
    random projection of equal rank), drawn as the report draws it, in ``<run dir>/figures``; none for the
    control. W&B logs it with the run (conf/logger/wandb.yaml ``run_images``)."""
    folder = run_dir / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    figures, _ = figure1(load_sweep([run_dir]), folder, n_images=4)
    return [(f.path, f.title) for f in figures]
