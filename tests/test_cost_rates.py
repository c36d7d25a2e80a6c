"""The cost estimate's rates (mdl/sweeps/rates.py): fitted to measured rows, a stack's member share, measured GPU
rows replacing the anchor-derived estimate, packs priced at a stack's rate; and the benchmark that prints the rows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import compose_config
from mdl.sweeps.cost import CONF_DIR, CostTable, main as cost_main
from mdl.sweeps.rates import MeasuredRates, Rate, fit_rate

REPO = Path(__file__).resolve().parents[1]
FLOPS = [1e6, 1e7, 1e8]


def test_fit_rate_recovers_an_exact_overhead_and_rate() -> None:
    rate = fit_rate(FLOPS, [0.002 + f / 1e9 for f in FLOPS])
    assert rate.overhead_s == pytest.approx(0.002, rel=1e-9) and rate.flops_per_s == pytest.approx(1e9, rel=1e-9)
    assert fit_rate([1e6], [0.5]) == Rate(0.0, 2e6)  # one row: through the origin


def _rows(
    model: str, members: int, overhead: float, rate: float, setting: str = "fp32", val: float = 1e-3
) -> list[dict]:
    """Rows whose step of ``members`` members takes members x (overhead + per-member FLOPs / rate)."""
    return [
        {
            "model": model,
            "fwd_flops": f / (3 * 128),
            "setting": setting,
            "members": members,
            "step_s": members * (overhead + f / rate),
            **({"val_batch_s": val} if members == 1 else {}),
        }
        for f in FLOPS
    ]


def test_a_stack_is_priced_at_its_members_share_of_a_measured_stacked_step() -> None:
    rates = MeasuredRates(_rows("mlp", 1, 1e-3, 1e9) + _rows("mlp", 10, 1e-4, 4e9), batch=128, eval_batch=1024)
    one, _, measured = rates.rates("mlp", "fp32", stacked=False, where="t")
    many, _, measured_many = rates.rates("mlp", "fp32", stacked=True, where="t")
    assert (one.overhead_s, one.flops_per_s) == pytest.approx((1e-3, 1e9), rel=1e-9) and not measured
    assert (many.overhead_s, many.flops_per_s) == pytest.approx((1e-4, 4e9), rel=1e-9) and measured_many
    # no stacked rows for LeNet: a stack is priced at one member's rate, and says so
    rates = MeasuredRates(_rows("lenet", 1, 1e-3, 1e9), batch=128, eval_batch=1024)
    assert rates.rates("lenet", "fp32", stacked=True, where="t")[1:] == (rates.val[("lenet", "fp32")], False)
    with pytest.raises(
        ValueError, match=r"no measured bf16 rate for model 'lenet' in t \(measured: \['lenet fp32'\]\)"
    ):
        rates.rates("lenet", "bf16", stacked=False, where="t")


def _table(tmp_path: Path, gpu_points: list[dict], overheads: float = 0.0) -> Path:
    """conf/cost/epoch_times.yaml with measured GPU rows (and the given overheads)."""
    data = yaml.safe_load((CONF_DIR / "cost/epoch_times.yaml").read_text())
    data["gpu"].update(
        points=gpu_points, batch=128, eval_batch=1024, fit_overhead_s=overheads, job_overhead_s=overheads, compile_s=0
    )
    path = tmp_path / "epoch_times.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_measured_gpu_rows_replace_the_anchor_and_a_stacked_run_costs_its_stack_rate(tmp_path: Path) -> None:
    """Known answer: overheads 0, validation negligible, a stack's member step at twice one member's FLOP rate:
    a run in one fit of all its members costs half the run in fits of one."""
    rows = _rows("mlp", 1, 0.0, 1e12, "fp32_highest", val=1e-30) + _rows("mlp", 10, 0.0, 2e12, "fp32_highest")
    table = CostTable(_table(tmp_path, rows))
    stacked, sequential = (compose_config(["model=mlp", f"mdl.members_per_fit={k}"]) for k in ("all", 1))
    anchored = CostTable("cost/epoch_times.yaml")
    assert table.job_seconds(stacked, "gpu") != anchored.job_seconds(stacked, "gpu")
    assert table.job_seconds(stacked, "gpu") == pytest.approx(table.job_seconds(sequential, "gpu") / 2, rel=1e-9)
    assert table.job_estimate(stacked, "gpu")[1] and not table.job_estimate(sequential, "gpu")[1]
    # fits of k members: the stack's rate too, and one fit overhead per fit
    table = CostTable(_table(tmp_path, rows, overheads=1.0))
    fits_of_3 = compose_config(["model=mlp", "mdl.members_per_fit=3"])
    members = stacked.mdl.num_blocks  # one per prequential block, the last the final fit
    assert table.job_seconds(fits_of_3, "gpu") - table.job_seconds(stacked, "gpu") == pytest.approx(
        -(-members // 3) - 1
    )


@pytest.mark.slow
def test_a_packed_sweep_is_priced_at_the_stack_rate_with_one_job_overhead_per_pack(tmp_path: Path, capsys) -> None:
    rows = _rows("mlp", 1, 0.0, 1e8, "fp32_highest", val=1e-30) + _rows("mlp", 10, 0.0, 2e8, "fp32_highest")
    path = _table(tmp_path, rows, overheads=100.0)
    sweep = [
        "model=mlp",
        "data=digits",
        "eraser=none,leace",
        "seed=0,1",
        "mdl.members_per_fit=1",
        f"hydra.callbacks.sweep_cost.table={path}",
    ]
    cost_main(sweep)
    printed = capsys.readouterr().out
    alone = float(re.search(r"estimated cost: ([\d.e+-]+) GPU-hours in all on one H200 ", printed).group(1))
    # one GPU named, and the CPU time said to be the sweep's total (it read as "per job")
    assert "(measured rows" not in printed and re.search(
        r"on CPUs instead: [\d.]+ [sh] in all, each job on one", printed
    )
    cost_main([*sweep[:-2], "mdl.members_per_fit=all", sweep[-1], "hydra/launcher=packed"])
    out = capsys.readouterr().out
    packed = float(re.search(r"estimated cost: ([\d.e+-]+) GPU-hours", out).group(1))
    assert "4 jobs in 1 pack" in out and "members' steps at the measured rate of a stack" in out
    # job by job: 4 x (1 job overhead + 10 fit overheads) + the steps; packed: one job, one fit of all 40 members
    # (mdl/engine/driver.py) + half the steps
    steps = (alone - (4 * 100 + 4 * 10 * 100) / 3600) * 3600
    assert packed * 3600 == pytest.approx(100 + 100 + steps / 2, rel=5e-3)  # the printout has 3 digits
    assert re.search(r"longest pack ([\d.]+) h", out) and "each pack one job" in out


@pytest.mark.slow  # composes a paper preset's sweeps (pack keys of preconditioned runs: tests/test_pack.py)
def test_preconditioned_runs_of_a_preset_are_one_pack_per_seed(capsys) -> None:
    """Preconditioned runs pack over seeds only; the paper presets set data_seed: ${seed}, so every seed is its own
    pack (the preset also sweeps 3 activations: 9 jobs); without preconditioning, one pack per activation."""
    cost_main(
        [
            "+experiment=paper/mlp_width",
            "+optimizer.precondition={p:-1,eps:1.0e-3}",
            "seed=0,1,2",
            "width=128",
            "eraser=none",
            "hydra/launcher=packed",
        ]
    )
    assert "9 jobs in 9 packs" in capsys.readouterr().out
    cost_main(
        [
            "+experiment=paper/mlp_width",
            "seed=0,1,2",
            "width=128",
            "eraser=none,leace",
            "hydra/launcher=packed",
            "protocol=sound",
        ]
    )
    assert "18 jobs in 3 packs" in capsys.readouterr().out
    # the presets' own protocol=original backtracks, which trains every run alone (mdl/run/pack.py): no packing
    cost_main(["+experiment=paper/mlp_width", "seed=0,1,2", "width=128", "eraser=none,leace", "hydra/launcher=packed"])
    assert "18 jobs in 18 packs" in capsys.readouterr().out


@pytest.mark.slow  # runs a benchmark script
def test_bench_epoch_times_prints_rows_the_cost_table_reads() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/bench_epoch_times.py"), "--points", "0", "--members", "2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    section = yaml.safe_load(done.stdout)
    rows = section["points"]
    assert [(r["model"], r["members"], r["setting"]) for r in rows] == [("mlp", 1, "fp32"), ("mlp", 2, "fp32")]
    assert rows[0]["step_s"] > 0 and rows[0]["val_batch_s"] > 0 and "val_batch_s" not in rows[1]
    rates = MeasuredRates(rows, batch=128, eval_batch=1024)
    assert rates.rates("mlp", "fp32", stacked=True, where="bench")[2]


@pytest.mark.slow
def test_docs_paper_md_states_the_cost_tool_s_bill() -> None:
    """docs/paper.md's jobs and GPU-hours per preset, their total and the example line are the tool's numbers
    (scripts/paper_costs.py rewrites them); before, the docs said 33 GPU-hours for App. C where the tool said 114."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "paper_costs.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
