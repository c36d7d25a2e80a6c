"""Every config value is checked before the heavy imports: a wrong one fails in about a second, not after torch,
lightning and the data are loaded; the light checks' tables stay equal to the code that owns each value."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from conftest import FAST, compose_config, run_launch
from mdl.run.config_checks import (
    CHOICES,
    MODEL_OPTION_VALUES,
    NAMED_BY_GROUP,
    check_before_imports,
    conf_names,
    group_file,
)


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.options.activation=tanh", "model.options.activation='tanh'"),
        ("+model.options.activaton=gelu", "did you mean model.options.activation"),
        ("eraser.name=lace", "did you mean leace"),
        ("trainer.precision=fp16", "trainer.precision"),
        ("data.source=cifar", "data.source"),
        ("data.augment_order=foo", "data.augment_order='foo'"),
        ("data.eval_labels=maybe", "data.eval_labels='maybe'"),
    ],
)
def test_a_wrong_value_fails_before_torch_is_imported(tmp_path: Path, override: str, named: str) -> None:
    proc = run_launch([override, f"paths.output_root={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr[-2000:]
    # launch.py says "loading torch and lightning" just before the heavy imports: the check came before them
    assert "loading torch" not in proc.stdout and not list(tmp_path.glob("store/*/config.json"))


def test_a_logger_whose_extra_is_missing_fails_before_the_imports(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("tensorboard", "tensorboardX") else real(name, *a),
    )
    with pytest.raises(ImportError, match=r"pip install -e '\.\[tensorboard\]'"):
        check_before_imports(compose_config(["logger=tensorboard"]))


@pytest.mark.parametrize("switch", ["mdl.reuse_across_environments", "skip_if_done"])
def test_a_switch_takes_true_or_false_only(switch: str) -> None:
    """Read as a boolean, ``foo`` would mean true: refused, naming the two values."""
    with pytest.raises(ValueError, match=f"{switch}='foo': choose one of (false, true|true, false)"):
        check_before_imports(compose_config([f"{switch}=foo"]))
    check_before_imports(compose_config([f"{switch}=false"]))


def test_the_defaults_presets_and_fast_settings_pass_the_early_checks() -> None:
    for overrides in (
        [],
        FAST,
        ["model=lenet"],
        ["model=swin"],
        ["model=convnext"],
        ["+experiment=paper/table16/smoke"],
    ):
        check_before_imports(compose_config(overrides))


def test_the_early_checks_tables_equal_their_owners() -> None:
    import datamodules
    import erasure
    import models
    from models import lenet, mlp, precision, swin
    from models.registry import model_builder

    from datamodules import settings

    assert CHOICES["trainer.precision"] == precision.PRECISIONS
    assert CHOICES["data.augment_order"] == settings.AUGMENT_ORDERS
    assert CHOICES["data.balance"] == (None, *settings.BALANCE_METHODS)
    assert CHOICES["eraser.fit_scope"] == settings.FIT_SCOPES
    for value in ("maybe", False):  # eval_labels: true or predicted, and nothing else
        with pytest.raises(ValueError, match="data.eval_labels"):
            settings.check_erasure_settings("erase_then_augment", value, False, None, "split", False)
    assert MODEL_OPTION_VALUES[("mlp", "activation")] == mlp.ACTIVATIONS
    assert MODEL_OPTION_VALUES[("lenet", "variant")] == lenet.VARIANTS
    assert MODEL_OPTION_VALUES[("swin", "head_scaling")] == tuple(swin.HEAD_SCALINGS)
    assert MODEL_OPTION_VALUES[("lenet", "activation")] == lenet.ACTIVATIONS
    registries = {
        "eraser.name": erasure.available_erasers(),
        "model.name": models.available_models(),
        "data.source": datamodules.available_sources(),
    }
    # test modules register their own (tests/test_loader.py's test_class_shift, at collection): not the project's
    registries = {key: [n for n in names if not n.startswith("test_")] for key, names in registries.items()}
    for key in NAMED_BY_GROUP:
        assert conf_names(key) == sorted(registries[key]), key
    for name in models.available_models():  # each model's config file defines every option its builder takes
        taken = set(inspect.signature(model_builder(name)).parameters) - {
            "width",
            "depth",
            "num_classes",
            "input_shape",
            "options",
        }
        assert set(group_file("model", name).options) == taken, name


def test_overfit_check_trains_with_the_runs_threads(monkeypatch) -> None:
    """debug=overfit trains with the run's CPU threads (trainer.torch_threads; 1 outside Slurm): with torch's default,
    2 threads on 2 shared cores made its 300 steps take 26 s instead of under 1 s."""
    import torch

    from mdl.run.debug_checks import overfit_one_batch

    torch.set_num_threads(2)
    cfg = compose_config(["debug=overfit", "trainer.torch_threads=1", "device=cpu"])
    try:
        assert overfit_one_batch(cfg, 20).steps == 20
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(2)


@pytest.mark.slow
def test_an_option_the_eraser_does_not_take_is_refused_before_the_data_are_loaded() -> None:
    """It was refused by the eraser's fit, after the data were loaded and split."""
    from mdl.run.config_checks import validate_config

    with pytest.raises(ValueError, match=r"did you mean eraser\.options\.shrinkage"):
        validate_config(compose_config([*FAST, "+eraser.options.shrinkge=0.1"]))
    for eraser in ("none", "leace", "qleace", "alf_qleace", "gradient", "random"):
        validate_config(compose_config([*FAST, f"eraser={eraser}"]))  # every shipped option is taken
    validate_config(compose_config([*FAST, "eraser=random", "eraser.options.rank_from=leace"]))


@pytest.mark.parametrize("model", ["convnext", "swin"])
def test_trainer_gpu_stacks_convnext_and_swin_where_stacks_pay(model: str) -> None:
    """On a CPU one member per fit is their faster grouping; under trainer=gpu (bf16 + compile) a stack trains more
    examples per second (conf/trainer/gpu.yaml cites the measurement), so it is their default there. A packed sweep
    packs them then, as it does MLPs (mdl.run.pack.pack_key)."""
    from mdl.run.pack import pack_key

    assert compose_config([f"model={model}"]).mdl.members_per_fit == 1
    on_gpu = compose_config([f"model={model}", "trainer=gpu"])
    assert on_gpu.mdl.members_per_fit == "auto"
    assert pack_key(compose_config([f"model={model}"])) is None and pack_key(on_gpu) is not None
    assert compose_config([f"model={model}", "trainer=gpu", "mdl.members_per_fit=1"]).mdl.members_per_fit == 1
