"""The ``callbacks`` config group: Lightning callbacks a user adds from the command line join every fit."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest

from conftest import FAST, compose_config
from mdl.run.config_checks import validate_config
from mdl.run.experiment import run_experiment
from mdl.run.identity import config_hash

STARTS: list[str] = []


class CountFits(L.Callback):
    """Records each fit it joins (a test double importable by Hydra's instantiate)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        STARTS.append(type(pl_module).__name__)


@pytest.mark.slow
@pytest.mark.parametrize("mode, fits", [("1", 3), ("all", 1)])
def test_a_callback_added_on_the_command_line_joins_every_fit(tmp_path: Path, mode: str, fits: int) -> None:
    STARTS.clear()
    cfg = compose_config(
        [*FAST, f"mdl.members_per_fit={mode}", "+callbacks.count._target_=test_callbacks_group.CountFits"], tmp_path
    )
    run_experiment(cfg, tmp_path / "run")
    assert len(STARTS) == fits  # mdl.num_blocks=3: 3 members (2 blocks and the final fit), one fit each or one in all


def test_callbacks_are_part_of_a_run_s_identity_and_none_keeps_old_hashes(tmp_path: Path) -> None:
    plain = config_hash(compose_config(FAST, tmp_path))
    assert config_hash(compose_config([*FAST, "callbacks=none"], tmp_path)) == plain
    assert config_hash(compose_config([*FAST, "callbacks=model_summary"], tmp_path)) != plain


@pytest.mark.slow
def test_model_summary_prints_the_model(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from mdl.run.experiment import quiet_lightning

    quiet_lightning()
    with caplog.at_level(logging.INFO):
        run_experiment(
            compose_config([*FAST, "callbacks=model_summary", "mdl.members_per_fit=1"], tmp_path), tmp_path / "r"
        )
    assert "Total params" in caplog.text


def test_a_callback_without_a_class_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"callbacks.bad=.*needs a class.*_target_="):
        validate_config(compose_config([*FAST, "+callbacks.bad=3"], tmp_path))
    with pytest.raises(ValueError, match=r"(?s)callbacks.gone: cannot build 'no.such.Callback'.*~callbacks.gone"):
        run_experiment(compose_config([*FAST, "+callbacks.gone._target_=no.such.Callback"], tmp_path), tmp_path / "r")
