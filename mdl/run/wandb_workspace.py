"""The project's saved W&B workspace: panels that answer the paper's questions, as code.

    python -m mdl.run.wandb_workspace --entity ENTITY --project PROJECT          # print what it shows
    python -m mdl.run.wandb_workspace --entity ENTITY --project PROJECT --save   # save it (needs a login)

Every panel reads a series or summary key the runs log (mdl.run.loggers); tests/test_wandb.py checks
each against the files of a real offline run, so a renamed key cannot leave a panel empty. Built with
``wandb-workspaces`` (the ``dev`` extra, or ``pip install wandb-workspaces``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class PanelSpec:
    """One panel: ``kind`` line (x = ``x``, y = the ``keys``, or every key matching ``regex``), bar
    (summary ``keys`` per group) or scatter (summary ``keys[1]`` against config ``keys[0]``)."""

    kind: str
    title: str
    question: str  # what a researcher reads off it
    keys: tuple[str, ...] = ()
    regex: str | None = None
    x: str = "epoch"
    groupby: str | None = None  # a config key: one line (mean and band) per value


@dataclass(frozen=True)
class SectionSpec:
    name: str
    panels: tuple[PanelSpec, ...] = field(default_factory=tuple)


SECTIONS = (
    SectionSpec(
        "The paper's numbers",
        (
            PanelSpec(
                "bar",
                "Paper MDL by eraser",
                "Does erasure slow learning? (the paper's table)",
                ("paper_mdl", "online_bits_per_example"),
                groupby="eraser.name",
            ),
            PanelSpec(
                "scatter",
                "Paper MDL against width",
                "Does the gap stay as the model grows? (Figure 3)",
                ("width", "paper_mdl"),
            ),
        ),
    ),
    SectionSpec(
        "Blocks, live",
        (
            PanelSpec(
                "line",
                "Validation loss of every block",
                "Which prefixes are hard to learn?",
                regex=r"block\d+/val_loss",
            ),
            PanelSpec(
                "line",
                "Validation accuracy of every block",
                "How well does each prefix's model classify?",
                regex=r"block\d+/val_accuracy",
            ),
            PanelSpec(
                "line",
                "Training loss of every block",
                "Is a block still training or stuck?",
                regex=r"block\d+/train_loss",
            ),
        ),
    ),
    SectionSpec(
        "Final fit",
        (
            PanelSpec(
                "line",
                "Final fit: validation loss by eraser",
                "Does the control learn faster? (backfiring)",
                ("final/val_loss",),
                groupby="eraser.name",
            ),
            PanelSpec(
                "line",
                "Final fit: validation accuracy by eraser",
                "How far below the control's accuracy?",
                ("final/val_accuracy",),
                groupby="eraser.name",
            ),
        ),
    ),
)


def build(entity: str, project: str, name: str = "Slowing learning: the paper's questions") -> Any:
    """The workspace object (nothing is sent until ``.save()``). Panels group by ``wr.Config``, the runset by
    ``expr.Config``: the library's two config-key types."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws
    from wandb_workspaces import expr

    def panel(p: PanelSpec) -> Any:
        groupby = wr.Config(p.groupby) if p.groupby else None
        if p.kind == "line":
            return wr.LinePlot(title=p.title, x=p.x, y=list(p.keys), metric_regex=p.regex, groupby=groupby)
        if p.kind == "bar":
            return wr.BarPlot(title=p.title, metrics=list(p.keys), groupby=groupby)
        if p.kind == "scatter":
            return wr.ScatterPlot(title=p.title, x=wr.Config(p.keys[0]), y=wr.SummaryMetric(p.keys[1]))
        raise ValueError(f"unknown panel kind {p.kind!r}")

    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=[ws.Section(name=s.name, panels=[panel(p) for p in s.panels], is_open=True) for s in SECTIONS],
        runset_settings=ws.RunsetSettings(groupby=[expr.Config("eraser.name")]),
    )


def describe() -> str:
    lines = []
    for section in SECTIONS:
        lines.append(f"{section.name}:")
        for p in section.panels:
            what = ", ".join(p.keys) if p.keys else f"keys matching {p.regex}"
            by = f", one line per {p.groupby}" if p.groupby else ""
            lines.append(f"  {p.title} ({p.kind}: {what}{by}) - {p.question}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mdl.run.wandb_workspace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--entity", required=True)
    parser.add_argument("--project", required=True, help="the logger's project (conf/logger/wandb.yaml)")
    parser.add_argument("--save", action="store_true", help="save it to W&B (needs `wandb login`)")
    args = parser.parse_args(argv)
    print(describe())
    if args.save:
        workspace = build(args.entity, args.project).save()
        print(f"saved: {workspace.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["SECTIONS", "build", "describe"]
