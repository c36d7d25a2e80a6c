"""The paper presets (conf/experiment/paper/): each composes to the values its comments document,
the sweep's cost is printed before any job runs, and every smoke version runs end to end."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from conftest import CONF, REPO, run_launch
from mdl.run.sweep_jobs import expand_sweep as sweep_jobs
from mdl.sweeps.cost import CostTable, main as cost_main

PAPER = CONF / "experiment" / "paper"
# preset -> (data source, jobs, fixed (key, value) of its figure)
PRESETS = {
    "appendix_c": ("cifar10", 100, None),
    "mlp_width": ("cifar10", 360, ("depth", 2)),
    "mlp_depth": ("cifar10", 360, ("width", 128)),
    "lenet_width": ("cifar10", 120, ("depth", 2)),
    "lenet_depth": ("cifar10", 120, ("width", 128)),
    "convnext_grid": ("cifar10", 300, None),
    "swin_grid": ("cifar10", 300, None),
    "svhn_width": ("svhn", 120, ("depth", 2)),
    "svhn_depth": ("svhn", 120, ("width", 128)),
    "cifarnet_width": ("cifarnet", 120, ("depth", 2)),
    "cifarnet_depth": ("cifarnet", 120, ("width", 128)),
    "table16": ("cifar10", 100, None),
}
# The original code's settings (EleutherAI/mdl, experiments/sweep_eraser.py and the probes), as documented.
LR = {"mlp": 5e-4, "lenet": 5e-4, "swin": 1e-3}
CONVNEXT_LR = {"none": 5e-5, "leace": 1e-4, "qleace": 1e-3, "alf_qleace": 1e-3, "gradient": 5e-5}
BETA1 = {"mlp": 0.95, "lenet": 0.95, "convnext": 0.9, "swin": 0.9}
WARMUP = {"mlp": 1000, "lenet": 0, "convnext": 0, "swin": 0}
BASE_WIDTH = {"mlp": 128, "lenet": 128, "convnext": 40, "swin": 40}  # swin: atto, vision_probe.py@5e66bb9:205


def compose_preset(overrides: list[str]) -> DictConfig:
    """conftest.compose_config, keeping the hydra node (the preset's sweeper params)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def preset_jobs(name: str, extra: Sequence[str] = ()) -> list[list[str]]:
    cfg = compose_preset([f"+experiment=paper/{name}"])
    return sweep_jobs(OmegaConf.to_container(cfg.hydra.sweeper.params), list(extra))


def expected_lr(model: str, eraser: str, source: str) -> float:
    if model == "convnext":
        return CONVNEXT_LR[eraser]
    return 1e-4 if (model, source) == ("mlp", "svhn") else LR[model]


def check_paper_settings(cfg: DictConfig, source: str) -> None:
    model, eraser = cfg.model.name, cfg.eraser.name
    assert cfg.data.source == source
    assert (cfg.trainer.patience, cfg.trainer.kwargs.max_epochs, cfg.trainer.matmul_precision) == (100, 30000, "high")
    assert cfg.data_seed == cfg.seed
    assert (cfg.mdl.num_blocks, cfg.data.val_size, cfg.data.first_block, cfg.data.batch_size) == (10, 2048, 1024, 128)
    assert cfg.data.augment and cfg.data.eval_labels is True
    assert cfg.data.augment_order == "erase_then_augment"  # D2: the original's order, both protocols
    assert cfg.protocol.name == "original"
    assert cfg.model.init == "original"  # D7: the builder's init under muP, as the original's models
    if model in ("convnext", "swin"):  # D5: the original's stochastic depth
        assert cfg.model.options.drop_path_rate == {"convnext": 0.1, "swin": 0.2}[model]
    assert cfg.optimizer.lr == pytest.approx(expected_lr(model, eraser, source))
    assert list(cfg.optimizer.betas) == [BETA1[model], 0.999]
    assert cfg.optimizer.warmup_steps == WARMUP[model] and cfg.optimizer.weight_decay == 0.0
    assert (cfg.model.base_width, cfg.model.base_depth) == (BASE_WIDTH[model], 2)
    # the erasers as the original fitted them (cli.py load_eraser): QLEACE with concept-erasure's default shrinkage,
    # LEACE and ALF-QLEACE without, ALF-QLEACE with no rank cap, the gradient eraser once on the pool
    shrinkage = cfg.eraser.options.get("shrinkage")
    assert shrinkage == {"qleace": "optimal", "leace": 0.0, "alf_qleace": 0.0}.get(eraser, shrinkage)
    if eraser == "alf_qleace":
        assert cfg.eraser.options.max_rank is None
    if eraser == "gradient":
        assert cfg.eraser.fit_scope == "pool"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_composes_to_its_documented_values(name: str) -> None:
    source, n_jobs, fixed = PRESETS[name]
    jobs = preset_jobs(name)
    assert len(jobs) == n_jobs
    assert {j.split("=")[0] for j in jobs[0]} >= {"eraser", "seed"}
    assert {j for job in jobs for j in job if j.startswith("seed=")} == {f"seed={s}" for s in range(5)}
    for job in (jobs[0], jobs[-1]):
        cfg = compose_preset([f"+experiment=paper/{name}", *job])
        check_paper_settings(cfg, source)
        if fixed is not None:
            assert cfg[fixed[0]] == fixed[1]
        if name in ("appendix_c", "table16"):  # base sizes
            assert (cfg.width, cfg.depth) == (cfg.model.base_width, 2)
        # z-scored data (paper Fig. 16) only in table16, at the data level as the original (not inside the eraser):
        # before erasure, but the gradient job's after it (its recipe, the original's, needs data in [0, 1])
        zscore = (name == "table16") and ("after_eraser" if cfg.eraser.name == "gradient" else True)
        assert cfg.data.zscore == zscore and not cfg.eraser.options.get("zscore", False)
        if cfg.eraser.name == "gradient":  # D3: the recipe of experiments/iterative_erasure.py@2a41748
            assert (cfg.eraser.options.recipe, cfg.eraser.options.history_size) == ("original", 100)


@pytest.mark.slow
def test_every_table16_job_composes_and_the_gradient_job_is_the_originals() -> None:
    """All 100 jobs compose (the interpolations per model and eraser resolve); the gradient jobs z-score after erasure
    with the original's recipe, the others before."""
    jobs = preset_jobs("table16")
    assert len(jobs) == 100
    seen = set()
    for job in jobs:
        if "seed=0" not in job:  # the seed changes nothing that is looked up
            continue
        cfg = compose_preset(["+experiment=paper/table16", *job])
        for key in ("data", "eraser", "model", "optimizer", "trainer", "mdl", "protocol"):
            OmegaConf.to_container(cfg[key], resolve=True)
        check_paper_settings(cfg, "cifar10")
        gradient = cfg.eraser.name == "gradient"
        assert cfg.data.zscore == ("after_eraser" if gradient else True)
        if gradient:
            assert cfg.eraser.options.recipe == "original" and cfg.eraser.fit_scope == "pool"
        seen.add((cfg.model.name, cfg.eraser.name))
    assert len(seen) == 20


def test_convnext_lr_follows_the_eraser_inside_one_multirun() -> None:
    jobs = [j for j in preset_jobs("table16") if "model=convnext" in j and "seed=0" in j]
    lrs = {}
    for job in jobs:
        cfg = compose_preset(["+experiment=paper/table16", *job])
        lrs[cfg.eraser.name] = cfg.optimizer.lr
    assert lrs == pytest.approx(CONVNEXT_LR)


def test_command_line_overrides_beat_the_presets_sweep() -> None:
    assert len(preset_jobs("appendix_c", ["seed=0"])) == 20
    assert len(preset_jobs("appendix_c", ["model=convnext", "eraser=none,leace"])) == 10
    cfg = compose_preset(["+experiment=paper/appendix_c", "model=mlp", "eraser=none", "seed=3", "data_seed=0"])
    assert (cfg.seed, cfg.data_seed) == (3, 0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_smoke_preset_is_the_same_sweep_on_digits_and_small(name: str) -> None:
    full, smoke = preset_jobs(name), preset_jobs(f"{name}/smoke")
    assert 1 <= len(smoke) <= 4
    assert [j.split("=")[0] for j in smoke[0]] == [j.split("=")[0] for j in full[0]]  # the same keys
    for job in smoke:
        cfg = compose_preset([f"+experiment=paper/{name}/smoke", *job])
        assert cfg.data.source == "digits" and cfg.data_seed == cfg.seed
        assert cfg.optimizer.lr == pytest.approx(expected_lr(cfg.model.name, cfg.eraser.name, PRESETS[name][0]))
        assert (cfg.model.base_width, cfg.optimizer.warmup_steps) == (
            BASE_WIDTH[cfg.model.name],
            WARMUP[cfg.model.name],
        )
        assert cfg.trainer.kwargs.max_epochs <= 4 and cfg.mdl.num_blocks <= 3 and cfg.width <= 16


def _undocumented_values(path: Path) -> list[str]:
    """Lines that set a value (not a bare key, a defaults entry or an interpolation) with no comment on
    the line itself or on the key that opens their block."""
    missing, parents = [], []  # parents: (indent, has comment) of the enclosing keys
    for line in path.read_text().splitlines():
        code = line.split("#", 1)[0].rstrip()
        if not code.strip():
            continue
        indent = len(code) - len(code.lstrip())
        parents = [p for p in parents if p[0] < indent]
        if code.endswith(":"):
            parents.append((indent, "#" in line))
        elif (
            not code.lstrip().startswith("-")
            and "${" not in code
            and "#" not in line
            and not any(c for _, c in parents)
        ):
            missing.append(line.strip())
    return missing


@pytest.mark.parametrize(
    "path", sorted(p for p in PAPER.glob("*.yaml") if p.name != "common_smoke.yaml"), ids=lambda p: p.stem
)
def test_every_preset_value_says_where_it_comes_from(path: Path) -> None:
    undocumented = _undocumented_values(path)
    assert not undocumented, f"{path.name}: values without a provenance comment: {undocumented}"


def test_no_unsourced_paper_claims_in_conf_or_readme() -> None:
    """ "(paper: X)" was used for values the paper does not state; provenance now names paper sections."""
    for path in [*CONF.rglob("*.yaml"), REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        assert not re.search(r"\(paper: ", path.read_text()), path


@pytest.mark.slow  # composes the paper's 100 jobs, 11 s (the cost of smaller sweeps: test_jobs_that_differ_only_in_bookkeeping...)
def test_cost_only_cli_prints_jobs_and_gpu_hours(capsys: pytest.CaptureFixture[str]) -> None:
    cost_main(["+experiment=paper/appendix_c"])
    out = capsys.readouterr().out
    assert "sweep: 100 jobs (model 4 x eraser 5 x seed 5)" in out
    assert re.search(r"estimated cost: [\d.]+ GPU-hours", out) and "nothing was launched" in out
    cost_main(["+experiment=paper/appendix_c", "seed=0"])
    assert "sweep: 20 jobs (model 4 x eraser 5)" in capsys.readouterr().out


def test_cost_grows_with_the_model() -> None:
    table = CostTable("cost/epoch_times.yaml")
    small, large = (
        compose_preset(["+experiment=paper/convnext_grid", "eraser=leace", f"width={w}", "depth=2"]) for w in (40, 96)
    )
    for device in ("gpu", "cpu"):
        assert table.job_seconds(large, device) > 2 * table.job_seconds(small, device) > 0


def _smoke_results(proc, tmp: Path) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted((tmp / "multirun").rglob("results.json"))]


@pytest.mark.slow  # a preset's sweep through launch.py
def test_smoke_preset_runs_end_to_end_after_printing_its_cost(tmp_path: Path) -> None:
    proc = run_launch(["-m", "+experiment=paper/mlp_width/smoke", f"paths.output_root={tmp_path}"], cwd=tmp_path)
    results = _smoke_results(proc, tmp_path)
    assert len(results) == 2
    assert "sweep: 2 jobs (width 2)" in proc.stdout and "GPU-hours" in proc.stdout
    assert proc.stdout.index("sweep: 2 jobs") < proc.stdout.index("paper MDL")  # before any job ran
    assert {r["config"]["width"] for r in results} == {8, 16}
    for r in results:
        assert r["config"]["optimizer"]["warmup_steps"] == 1000 and r["config"]["data_seed"] == r["config"]["seed"]


@pytest.mark.slow
def test_every_smoke_preset_runs(tmp_path: Path) -> None:
    """All families, two at a time (each job trains on one thread): a few minutes on 2 CPU cores."""

    def run(name: str) -> tuple[str, int, list[dict], list[Path]]:
        out = tmp_path / name
        out.mkdir()
        proc = run_launch(["-m", f"+experiment=paper/{name}/smoke", f"paths.output_root={out}"], cwd=out)
        jobs = int(re.search(r"sweep: (\d+) jobs", proc.stdout).group(1)) if proc.returncode == 0 else -1
        return name, jobs, _smoke_results(proc, out), sorted((out / "multirun").glob("*/*/report/*.csv"))

    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, jobs, results, report in pool.map(run, sorted(PRESETS)):
            assert len(results) == jobs >= 1, name
            assert report, f"{name}: no sweep report"
            # every smoke's report compares with the paper's table, even on digits (common_smoke.yaml)
            assert any(p.name == "paper_comparison.csv" for p in report), name
            for r in results:
                c = r["config"]
                assert c["data"]["source"] == "digits", name
                assert c["optimizer"]["lr"] == pytest.approx(
                    expected_lr(c["model"]["name"], c["eraser"]["name"], PRESETS[name][0])
                )


def test_lr_search_preset_trains_the_base_width_over_an_lr_grid() -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for model in ("mlp", "lenet", "convnext"):
            cfg = compose("config", overrides=["+experiment=lr_search", f"model={model}"], return_hydra_config=True)
            assert cfg.width == cfg.model.base_width  # muP: tune at the base width, transfer to the others
            lrs = [float(v) for v in str(cfg.hydra.sweeper.params["optimizer.lr"]).split(",")]
            assert len(lrs) >= 4 and lrs == sorted(lrs)


@pytest.mark.slow
def test_jobs_that_differ_only_in_bookkeeping_are_priced_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep over a bookkeeping key (mdl/run/identity.py) runs the same config twice: it is trained once and
    skipped after, so it costs what the sweep without that key costs."""
    cost_main(["+experiment=paper/appendix_c", "seed=0", "model=mlp"])
    plain = re.search(r"estimated cost: ([\d.]+) GPU-hours", capsys.readouterr().out).group(1)
    cost_main(["+experiment=paper/appendix_c", "seed=0", "model=mlp", "mdl.checkpoint_every_s=10,30"])
    out = capsys.readouterr().out
    assert "sweep: 10 jobs" in out and re.search(r"estimated cost: ([\d.]+) GPU-hours", out).group(1) == plain
