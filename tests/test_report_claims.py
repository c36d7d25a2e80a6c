"""The claims section (mdl/report/claims.py): the paper's conclusions, each tested on a sweep's cells.

Runs are results.json files written here with chosen paper MDL per seed (tests/test_report_protocols.py's
``protocol_run``), so every difference, interval and verdict is known by hand.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST, run_launch, sweep_report
from test_report_protocols import protocol_run

from mdl.report.build import main as report_main
from mdl.results import write_checked_json
from mdl.report.claims import Claim, Difference, interval, judge, load_claims, welch
from mdl.report.sweep import load_sweep
from mdl.report.stats import Cell, build_cells

T_975_DF2 = 4.302652729911275  # Student's t, two-sided 95%, 2 degrees of freedom (tables)


def test_welch_interval_has_the_textbook_value() -> None:
    value, se, df = welch(np.array([1.0, 2.0, 3.0]), np.array([0.0, 0.0, 0.0]))
    assert (value, df) == (2.0, 2.0) and se == pytest.approx(math.sqrt(1 / 3))
    low, high = interval(value, se, df, 0.95)
    assert (low, high) == pytest.approx((2 - T_975_DF2 * math.sqrt(1 / 3), 2 + T_975_DF2 * math.sqrt(1 / 3)))
    assert math.isnan(welch(np.array([1.0]), np.array([0.0, 1.0]))[1])  # one seed: no spread, no interval


CLAIM = Claim("c", "says", "Sec. 4", "every", ("leace",), ("none",))


def diff(value: float, half: float, arch: str = "mlp", row: tuple = ()) -> Difference:
    """A cell's difference with a chosen interval half-width (NaN: one seed)."""
    cell = Cell(arch, row, "leace")
    return Difference(arch, row, cell, cell, value, half / 2, 10.0, value - half, value + half)


@pytest.mark.parametrize(
    ("kind", "cells", "word"),
    [
        ("every", [(3.0, 1.0), (2.0, 1.0)], "supported"),
        ("every", [(3.0, 1.0), (-2.0, 1.0)], "contradicted"),  # one cell the other way
        ("every", [(3.0, 1.0), (0.5, 1.0)], "not enough seeds"),  # one interval holds 0
        ("every", [(3.0, math.nan)], "not enough seeds"),  # one seed
        ("most", [(3.0, 1.0), (2.0, 1.0), (0.5, 1.0)], "supported"),  # 2 of 3 agree
        ("most", [(3.0, 1.0), (-2.0, 1.0), (-2.0, 1.0)], "contradicted"),
        ("most", [(3.0, 1.0), (-2.0, 1.0), (0.5, 1.0)], "not enough seeds"),
    ],
)
def test_a_claims_verdict_follows_its_cells_intervals(kind: str, cells: list, word: str) -> None:
    claim = Claim("c", "says", "Sec. 4", kind, ("leace",), ("none",))
    assert judge(claim, [diff(v, h) for v, h in cells], 0.95).word == word
    assert judge(claim, [], 0.95).word == "not tested"


def test_a_flat_claim_is_contradicted_only_by_rows_that_differ_beyond_their_intervals() -> None:
    flat = Claim("c", "says", "Sec. 4", "flat", ("leace",), ("none",))
    close = [diff(7.0, 1.0, row=(64,)), diff(7.5, 1.0, row=(256,))]
    apart = [diff(7.0, 0.2, row=(64,)), diff(9.0, 0.2, row=(256,))]
    assert judge(flat, close, 0.95).word == "supported"
    verdict = judge(flat, apart, 0.95)
    assert verdict.word == "contradicted" and verdict.measured.startswith("mlp: cells differ by up to +2.00")
    assert judge(flat, close[:1], 0.95).word == "not tested"  # one row: nothing to compare
    between = [diff(7.0, 0.2, row=(64,)), diff(7.1, 0.2, row=(256,)), diff(9.0, 0.2, arch="lenet", row=(64,))]
    verdict = judge(flat, between, 0.95)  # flat within MLP, but LeNet's effect is larger: not "roughly equal"
    assert verdict.word == "contradicted" and "all architectures: cells differ by up to +2.00" in verdict.measured


def test_every_shipped_claim_is_well_formed() -> None:
    shipped = load_claims()
    assert 0 < shipped.confidence < 1 and 0 < shipped.at_chance_bits < 0.5
    assert len({c.id for c in shipped.claims}) == len(shipped.claims)
    for c in shipped.claims:
        assert c.says and c.section.startswith("Sec. ") and not set(c.higher) & set(c.lower)
        assert set(c.higher) | set(c.lower) <= {"none", "leace", "qleace", "alf_qleace", "gradient"}


def claims_sweep(root: Path) -> Path:
    """MLP under both protocols, 3 seeds: LEACE far above none under both; QLEACE above LEACE under sound, at the
    same level under original (both at chance, the digits case)."""
    means = {
        ("sound", "none"): 1.2,
        ("sound", "leace"): 8.8,
        ("sound", "qleace"): 14.7,
        ("original", "none"): 1.2,
        ("original", "leace"): 14.7,
        ("original", "qleace"): 14.7,
    }
    job = 0
    for (protocol, eraser), mean in means.items():
        for seed, noise in enumerate((-0.1, 0.0, 0.1)):
            protocol_run(root, job, protocol, eraser, seed, mean + noise * (1 + job % 2), [0, 2])
            job += 1
    return root


def test_the_section_gives_each_claim_per_protocol_with_its_cells(tmp_path: Path) -> None:
    from mdl.report.claims import claims_section

    sweep = load_sweep([claims_sweep(tmp_path)])
    text = "\n".join(claims_section(sweep, build_cells(sweep)))
    head = [line for line in text.splitlines() if line.startswith("| `") and line.count("|") == 6]  # 5 columns
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in head}
    assert "**supported**" in rows[("`leace_slows`", "original")] and "mlp 1" in rows[("`leace_slows`", "original")]
    assert "**supported**" in rows[("`qleace_above_leace_feedforward`", "sound")]
    assert "**not enough seeds**" in rows[("`qleace_above_leace_feedforward`", "original")]
    assert "+7.60 [" in text  # sound: 8.8 - 1.2, both cells' noise symmetric
    assert "| `leace_slows` | sound | mlp | leace − none |" in text  # the cell, in the table of cells
    assert "1 of 6 (1, 0, 0)" not in text and "3 of 6 (1, 1, 1)" in text  # blocks at the untrained model per seed
    assert "Not tested by this sweep" in text and "qleace_lowest_convnext" in text  # no ConvNeXt in the sweep
    assert '"Applying LEACE to datasets consistently increases MDL' in text  # the paper's words beside the ids


def test_the_cli_prints_the_claims_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = claims_sweep(tmp_path / "sweep")
    assert report_main([str(sweep), "--claims"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## The paper's claims") and "`leace_slows`" in out
    assert not (sweep / "report").exists()
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty"), "--claims"]) == 2
    assert "no readable results.json" in capsys.readouterr().err


def test_the_erasure_each_eraser_achieved_is_reported_beside_the_claims(tmp_path: Path) -> None:
    from mdl.report.erasure import erasure_section

    probes = {
        "none": None,  # the control records no erasure
        "qleace": ({"linear_probe_acc": (0.96, 0.134), "qda_acc": (0.94, 0.32)}, False),
        "leace": ({"linear_probe_acc": (0.96, 0.24), "qda_acc": (0.94, 0.90)}, None),
    }
    for job, (eraser, record) in enumerate(probes.items()):
        for seed in (0, 1):
            path = protocol_run(tmp_path, 2 * job + seed, "sound", eraser, seed, 5.0, [1])
            results = json.loads(path.read_text())
            if record is not None:
                accs, met = record
                erasure = {f"{k}_{when}": v[i] for k, v in accs.items() for i, when in enumerate(("before", "after"))}
                results["data_diagnostics"] = {"erasure": {**erasure, "chance": 0.0994}}
                if met is not None:
                    results["data_diagnostics"]["erasure_criterion"] = {"checked": True, "met": met}
            write_checked_json(path, results)
    sweep = load_sweep([tmp_path])
    text = "\n".join(erasure_section(build_cells(sweep)))
    assert "| leace | 0.96 → 0.24 | 0.94 → 0.90 | 0.10 | not judged | 2 |" in text
    assert "| qleace | 0.96 → 0.13 | 0.94 → 0.32 | 0.10 | 0 of 2 runs | 2 |" in text
    assert "| none |" not in text


@pytest.mark.slow  # a multirun of 8 debug=fast jobs through launch.py, about a minute on 2 CPU cores
def test_the_claims_preset_ends_with_the_claims_on_the_console(tmp_path: Path) -> None:
    small = ["model=mlp", "width=32", "eraser=none,leace", "seed=0,1", *FAST]
    proc = run_launch(["-m", "+experiment=paper/claims_digits", *small, f"paths.output_root={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sweep: 8 jobs (protocol 2 x eraser 2 x seed 2)" in proc.stdout
    printed = proc.stdout[proc.stdout.rindex("## The paper's claims") :]
    assert "| `leace_slows` | original | mlp 1 |" in printed and "| `leace_slows` | sound | mlp 1 |" in printed
    assert not re.search(r"paper MDL: \d", printed)  # after the last job's "paper MDL: <bits> bits/example" line
    assert "## The paper's claims" in sweep_report(tmp_path).read_text()


def test_two_erasers_both_at_chance_do_not_support_an_ordering(tmp_path: Path) -> None:
    """Digits' QLEACE and gradient cells: every fit kept at the untrained model, both score a uniform predictor's
    paper MDL, so neither costs more bits; more seeds would not change it."""
    from mdl.report.claims import claims_section, differences

    chance = math.log2(3) * (20 + 30) / 30  # 3 classes, blocks at 10, 20, 30 (mdl.codelength.paper_mdl)
    for job, (eraser, mdl) in enumerate([("qleace", chance), ("gradient", chance - 0.01), ("none", 1.0)] * 2):
        path = protocol_run(tmp_path, job, "sound", eraser, job // 3, mdl, [0, 0])
        results = json.loads(path.read_text())
        write_checked_json(path, results | {"boundaries": [10, 20, 30]})
    sweep = load_sweep([tmp_path])
    shipped = load_claims()
    claim = next(c for c in shipped.claims if c.id == "gradient_below_qleace_feedforward")
    (d,) = differences(claim, build_cells(sweep), shipped.confidence, shipped.at_chance_bits)
    assert d.direction == "both at chance" and judge(claim, [d], 0.95).word == "contradicted"
    gradient_slows = next(c for c in shipped.claims if c.id == "gradient_slows")
    (d,) = differences(gradient_slows, build_cells(sweep), shipped.confidence, shipped.at_chance_bits)
    assert d.direction == "agrees"  # one side at chance, the control far below it
    text = "\n".join(claims_section(sweep, build_cells(sweep)))
    assert "+0.01 (one seed)" not in text and "(both at chance)" in text
