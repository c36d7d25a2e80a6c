"""The paper's conclusions, each tested on a sweep: its cells, the difference with an interval, a verdict.

Why: tables per protocol and per architecture leave the reader to work out whether a sweep supports what the
paper concludes, and on digits the answer depends on the training loop. The claims are data
(``mdl/paper_values/claims.yaml``: the paper's sentence, its section, which eraser it says costs more bits, where);
this module measures each in every architecture x row cell the sweep has both erasers of:

- the difference of mean paper MDL (``higher`` minus ``lower``) with a Welch interval over seeds (unpaired: seeds
  of two erasers share no draw that pairing could use; a cell needs 2 seeds on each side);
- a cell *agrees* when its interval lies above 0, *disagrees* when below, is *undecided* otherwise; when both
  erasers' means sit at a uniform predictor's paper MDL (within ``at_chance_bits``) the cell is *both at chance*
  and counts as disagreeing: nothing was learnt on either side, so neither eraser costs more bits (digits' QLEACE
  and gradient cells), and more seeds would not change that;
- a claim is *supported* when every cell agrees (``kind: every``) or more than half do (``most``); *contradicted*
  when a cell disagrees (``every``) or more than half do (``most``); else *not enough seeds*. A ``flat`` claim
  compares the cells with the largest and the smallest difference, within each architecture and over all of them:
  contradicted when such a gap's interval lies above 0, supported otherwise (2 cells or more). A claim whose cells the sweep lacks is *not tested*.

A sweep over ``protocol`` gets each claim per protocol (``mdl.report.protocols.split_by_protocol``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Sequence

import numpy as np
import yaml
from scipy.stats import t as student_t

from mdl.report.protocols import split_by_protocol, untrained_text
from mdl.report.sweep import PROTOCOL_KEY, Sweep, group_by
from mdl.report.stats import Cell, chance_level
from mdl.report.tables import markdown_table

METRIC = "paper_mdl"
KINDS = ("every", "most", "flat")


@dataclass(frozen=True)
class Claim:
    """One conclusion of the paper as a comparison of two erasers' paper MDL (mdl/paper_values/claims.yaml)."""

    id: str
    says: str
    section: str
    kind: str
    higher: tuple[str, ...]
    lower: tuple[str, ...]
    architectures: tuple[str, ...] | None = None

    def speaks_of(self, arch: str) -> bool:
        return self.architectures is None or arch.split("-")[0] in self.architectures


@dataclass(frozen=True)
class Difference:
    """``higher`` minus ``lower`` mean paper MDL in one cell, with its interval (NaN with fewer than 2 seeds)."""

    arch: str
    row: tuple[Any, ...]
    higher: Cell
    lower: Cell
    value: float
    se: float
    df: float
    low: float
    high: float
    both_at_chance: bool = False

    @property
    def direction(self) -> str:
        if self.both_at_chance:
            return "both at chance"
        if math.isnan(self.low):
            return "one seed"
        return "agrees" if self.low > 0 else "disagrees" if self.high < 0 else "undecided"


@dataclass(frozen=True)
class ClaimSet:
    """The shipped claims and how they are judged (mdl/paper_values/claims.yaml)."""

    claims: tuple[Claim, ...]
    confidence: float  # of every interval
    at_chance_bits: float  # a mean within this of a uniform predictor's paper MDL is at chance


@cache
def load_claims() -> ClaimSet:
    """The shipped claims with their judging settings; a malformed entry names itself."""
    text = resources.files("mdl").joinpath("paper_values/claims.yaml").read_text()
    data = yaml.safe_load(text)
    claims = []
    for entry in data["claims"]:
        if entry.get("kind") not in KINDS:
            raise ValueError(f"claims.yaml: claim {entry.get('id')!r} has kind {entry.get('kind')!r}; one of {KINDS}")
        as_tuple = lambda v: tuple(v) if isinstance(v, list) else (v,)  # noqa: E731 - a one-line normaliser
        archs = entry.get("architectures")
        claims.append(
            Claim(
                entry["id"],
                " ".join(entry["says"].split()),
                entry["section"],
                entry["kind"],
                as_tuple(entry["higher"]),
                as_tuple(entry["lower"]),
                tuple(archs) if archs else None,
            )
        )
    return ClaimSet(tuple(claims), float(data["confidence"]), float(data["at_chance_bits"]))


def welch(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """mean(a) - mean(b), its standard error and Welch-Satterthwaite degrees of freedom (NaN below 2 each)."""
    if a.size < 2 or b.size < 2:
        return float(a.mean() - b.mean()) if a.size and b.size else math.nan, math.nan, math.nan
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if va + vb > 0 else math.inf
    return float(a.mean() - b.mean()), se, df


def interval(value: float, se: float, df: float, confidence: float) -> tuple[float, float]:
    """The two-sided ``confidence`` interval of a t-distributed estimate (a zero se gives the point itself)."""
    if math.isnan(se) or math.isnan(df):
        return math.nan, math.nan
    half = 0.0 if se == 0 else float(student_t.ppf(0.5 + confidence / 2, df)) * se
    return value - half, value + half


def _base(eraser_label: str) -> str:
    """'alf_qleace (max_rank=15)' -> 'alf_qleace': a claim names erasers, a sweep may split them by option."""
    return eraser_label.split(" ")[0]


def differences(claim: Claim, cells: Sequence[Cell], confidence: float, at_chance_bits: float) -> list[Difference]:
    """Every (higher, lower) pair of cells in one architecture x row that the claim speaks of."""
    out = []
    for (arch, row), mine in group_by((c for c in cells if claim.speaks_of(c.arch)), lambda c: (c.arch, c.row)).items():
        for hi in (c for c in mine if _base(c.eraser) in claim.higher):
            for lo in (c for c in mine if _base(c.eraser) in claim.lower and c is not hi):
                a, b = hi.values(METRIC), lo.values(METRIC)
                value, se, df = welch(a, b)
                if math.isnan(value):
                    continue
                chance = chance_level([hi, lo], METRIC)
                idle = chance is not None and min(a.mean(), b.mean()) >= chance - at_chance_bits
                out.append(Difference(arch, row, hi, lo, value, se, df, *interval(value, se, df, confidence), idle))
    return out


@dataclass(frozen=True)
class Verdict:
    word: str  # supported | contradicted | not enough seeds | not tested
    measured: str  # the difference (or range of differences) that decided it, with its interval


def judge(claim: Claim, diffs: Sequence[Difference], confidence: float) -> Verdict:
    """The claim's verdict from its cells' differences (the rules in this module's docstring)."""
    if not diffs:
        return Verdict("not tested", "the sweep has no cell with both erasers")
    if claim.kind == "flat":
        return _judge_flat(diffs, confidence)
    ways = [d.direction for d in diffs]
    agree, idle = ways.count("agrees"), ways.count("both at chance")
    disagree = ways.count("disagrees") + idle
    if claim.kind == "every":
        word = "contradicted" if disagree else "supported" if agree == len(ways) else "not enough seeds"
    else:
        word = (
            "supported" if agree > len(ways) / 2 else "contradicted" if disagree > len(ways) / 2 else "not enough seeds"
        )
    if len(diffs) == 1:
        return Verdict(word, with_interval(diffs[0]) + (", both at chance" if idle else ""))
    values = sorted(d.value for d in diffs)
    at_chance = f" ({idle} both at chance)" if idle else ""
    counts = f"{agree} agree, {disagree} disagree{at_chance}, {len(ways) - agree - disagree} undecided"
    return Verdict(word, f"{values[0]:+.2f} to {values[-1]:+.2f} over {len(diffs)} cells ({counts})")


def _judge_flat(diffs: Sequence[Difference], confidence: float) -> Verdict:
    """The gap between the largest and the smallest difference within each architecture (widths, depths) and,
    with two architectures or more, over all cells ("roughly equal between architectures"); any gap decides."""
    groups = {arch: [d for d in diffs if d.arch == arch] for arch in dict.fromkeys(d.arch for d in diffs)}
    if len(groups) > 1:
        groups["all architectures"] = list(diffs)
    gaps = []
    for name, members in groups.items():
        if len(members) < 2:
            continue
        bottom, top = min(members, key=lambda d: d.value), max(members, key=lambda d: d.value)
        se = math.sqrt(top.se**2 + bottom.se**2)
        df = se**4 / (top.se**4 / top.df + bottom.se**4 / bottom.df) if se > 0 else math.inf
        gap = top.value - bottom.value
        gaps.append((name, gap, *interval(gap, se, df, confidence)))
    if not gaps:
        return Verdict("not tested", "one cell: nothing to compare")
    if any(math.isnan(lo) for _, _, lo, _ in gaps):
        return Verdict("not enough seeds", "a row has fewer than 2 seeds")
    word = "contradicted" if any(lo > 0 for _, _, lo, _ in gaps) else "supported"
    return Verdict(
        word, "; ".join(f"{a}: cells differ by up to {g:+.2f} [{lo:.2f}, {hi:.2f}]" for a, g, lo, hi in gaps)
    )


def with_interval(d: Difference) -> str:
    """'+7.59 [7.21, 7.97]' (or '+7.59 (one seed)')."""
    if math.isnan(d.low):
        return f"{d.value:+.2f} (one seed)"
    return f"{d.value:+.2f} [{d.low:.2f}, {d.high:.2f}]"


def claims_section(sweep: Sweep, cells: Sequence[Cell]) -> list[str]:
    """Markdown: a line per claim (per protocol when the sweep ran both), then a line per tested cell."""
    judging = load_claims()
    claims, confidence = judging.claims, judging.confidence
    parts = split_by_protocol(sweep, cells) or [(_protocol_of(sweep), sweep, list(cells))]
    head, detail, tested = [], [], {}
    for claim in claims:
        for protocol, sub, mine in parts:
            diffs = differences(claim, mine, confidence, judging.at_chance_bits)
            verdict = judge(claim, diffs, confidence)
            if verdict.word != "not tested":
                tested[claim.id] = claim
                head.append([f"`{claim.id}`", protocol, _cells(diffs), verdict.measured, f"**{verdict.word}**"])
                detail += [_detail_row(claim, protocol, sub, d) for d in diffs]
    lines = [
        "## The paper's claims",
        "",
        f"Each conclusion of the paper (mdl/paper_values/claims.yaml) tested on this sweep's paper MDL: the difference "
        f"of the means (the eraser the paper says costs more bits minus the other), with its {confidence:.0%} Welch "
        f"interval over seeds, and a verdict (rules: mdl/report/claims.py).",
        "",
    ]
    if head:
        lines += [markdown_table(["claim", "protocol", "cells", "difference (bits/example)", "verdict"], head), ""]
        lines += ["\n".join(f'- `{c.id}` ({c.section}): "{c.says}"' for c in tested.values()), ""]
        header = [
            "claim",
            "protocol",
            "cell",
            "higher − lower",
            "difference",
            "seeds",
            "blocks at the untrained model (higher; lower)",
        ]
        lines += [markdown_table(header, detail), ""]
    untested = [c.id for c in claims if c.id not in tested]
    if untested:
        lines += [f"Not tested by this sweep (it lacks their architectures or erasers): {', '.join(untested)}.", ""]
    return lines


def _cells(diffs: Sequence[Difference]) -> str:
    """'mlp 2, lenet 2': how many cells of each architecture test a claim (the table below lists them)."""
    archs = [d.arch for d in diffs]
    return ", ".join(f"{a} {archs.count(a)}" for a in dict.fromkeys(archs))


def _detail_row(claim: Claim, protocol: str, sweep: Sweep, d: Difference) -> list[str]:
    where = ", ".join(filter(None, [d.arch, sweep.describe(d.row)]))
    return [
        f"`{claim.id}`",
        protocol,
        where,
        f"{d.higher.eraser} − {d.lower.eraser}",
        f"{with_interval(d)} ({d.direction})",
        f"{d.higher.n}, {d.lower.n}",
        f"{untrained_text(d.higher)}; {untrained_text(d.lower)}",
    ]


def _protocol_of(sweep: Sweep) -> str:
    """The one protocol a sweep ran (its runs' ``protocol.name``), '-' for runs from before the key."""
    names = {r.flat.get(PROTOCOL_KEY) for r in sweep.runs}
    return ", ".join(sorted(str(n).strip('"') for n in names if n is not None)) or "-"
