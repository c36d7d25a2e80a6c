"""``protocol.final_fit``: the original trains no fit on all N examples (mdl/sweep.py@3034bc0:104-150), so
``protocol=original`` trains its blocks only. The blocks, and every number made of them, are those of the same run
with a final fit; the final fit's fields are null and its curves empty, and the summary says there was none."""

from __future__ import annotations

from pathlib import Path

from conftest import FAST, run_in_process
from mdl.run.console import summary

BLOCK_NUMBERS = ("paper_mdl", "paper_mdl_val_min", "online_codelength_bits", "blocks", "boundaries")
FINAL_FIELDS = ("final_val_loss", "final_epochs", "final_test_bits_per_example")


def test_without_a_final_fit_the_blocks_are_the_same_and_the_final_fields_null(tmp_path: Path) -> None:
    overrides = [*FAST, "mdl.members_per_fit=1"]  # one member per fit: the final member is a fit of its own
    with_final = run_in_process([*overrides, "protocol.final_fit=true"], tmp_path / "with")
    without = run_in_process([*overrides, "protocol.final_fit=false"], tmp_path / "without")
    assert {k: without[k] for k in BLOCK_NUMBERS} == {k: with_final[k] for k in BLOCK_NUMBERS}
    assert all(with_final[k] is not None for k in FINAL_FIELDS[:2]) and with_final["val_loss_curve"]
    assert all(without[k] is None for k in FINAL_FIELDS)
    assert without["val_loss_curve"] == without["train_loss_curve"] == without["val_accuracy_curve"] == []
    assert "final fit: none (protocol.final_fit=false" in summary(without, tmp_path / "results.json")


def test_a_stacked_run_without_a_final_fit_stacks_its_blocks_only(tmp_path: Path) -> None:
    """mdl.engine.memory.plan_fits leaves the final member out of every fit, a stack of all members included."""
    with_final = run_in_process([*FAST, "protocol.final_fit=true"], tmp_path / "with")
    without = run_in_process([*FAST, "protocol.final_fit=false"], tmp_path / "without")
    assert {k: without[k] for k in BLOCK_NUMBERS} == {k: with_final[k] for k in BLOCK_NUMBERS}
    assert without["final_epochs"] is None and with_final["final_epochs"] > 0


def test_the_max_ent_probes_of_a_final_fit_that_is_not_trained_are_refused(tmp_path: Path) -> None:
    import pytest

    from conftest import compose_config
    from mdl.run.config_checks import check_before_imports

    with pytest.raises(ValueError, match="protocol.final_fit=true"):
        check_before_imports(compose_config(["protocol=original", "probes=maxent"], tmp_path))
    check_before_imports(compose_config(["protocol=original", "probes=maxent", "protocol.final_fit=true"], tmp_path))
