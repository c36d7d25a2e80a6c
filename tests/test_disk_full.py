"""A full disk: checked before training from the checkpoints' estimated size, reported as one
message naming the folder and the setting when it fills mid-run, and never the cause of lost work
(a stacked run's checkpoint outlives a failed results write, so the re-run trains nothing again)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from conftest import FAST, compose_config, run_launch
from mdl.engine import checkpoints
from mdl.run import components, experiment
from mdl.run.config_checks import check_trainer_config
from mdl.run.experiment import CHECKPOINT_BYTES_PER_PARAMETER, checkpoint_bytes, run_experiment
from mdl.results import RESULTS_FILE

STACKED = FAST + [
    "mdl.members_per_fit=all",
    "mdl.checkpoint_every_s=0",
    "mdl.min_steps_per_pass=1",
    "trainer.torch_threads=1",
]
NUMBERS = ("paper_mdl", "online_codelength_bits", "final_val_loss")


def test_results_write_on_a_full_disk_keeps_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = run_experiment(compose_config(STACKED, tmp_path / "ref"), tmp_path / "ref" / "run")

    real_write = experiment.write_checked_json

    def full_disk(path, payload):
        if Path(path).name == RESULTS_FILE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write(path, payload)

    cfg = compose_config(STACKED, tmp_path / "full")
    monkeypatch.setattr(experiment, "write_checked_json", full_disk)
    sizes: list[int] = []
    real_save = checkpoints.write_checksummed
    monkeypatch.setattr(
        checkpoints,
        "write_checksummed",
        lambda path, payload, stamp="": (sizes.append(len(payload)), real_save(path, payload, stamp))[1],
    )
    with pytest.raises(OSError) as err:
        run_experiment(cfg, tmp_path / "full" / "run")
    message = str(err.value)
    assert (
        "the disk is full" in message
        and "paths.output_root" in message
        and "resumes from its last checkpoint" in message
    )
    (checkpoint,) = (tmp_path / "full" / "store").glob("*/checkpoints/stacked.ckpt")

    # the estimate covers the largest checkpoint written (twice over for the write beside the old one), within 3x
    size = max(sizes)
    dm = components.make_datamodule(cfg, check_trainer_config(cfg))
    estimate = checkpoint_bytes(cfg, components.make_model_factory(cfg, dm.num_classes, dm.input_shape))
    assert size <= estimate / 2 <= 3 * size, (size, estimate, CHECKPOINT_BYTES_PER_PARAMETER)

    monkeypatch.setattr(experiment, "write_checked_json", real_write)
    resumed = run_experiment(compose_config(STACKED, tmp_path / "full"), tmp_path / "full" / "run2")
    assert {k: resumed[k] for k in NUMBERS} == {k: reference[k] for k in NUMBERS}
    assert resumed["blocks"] == reference["blocks"]
    assert not checkpoint.exists()  # finished: the checkpoint is removed once the results are safe


def mount_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.slow  # a launch on a real tmpfs (the same errors in process: the tests beside it)
def test_too_little_room_for_the_checkpoints_fails_before_training(tmp_path: Path) -> None:
    """A real 1 MiB file system: the stacked run's checkpoints need more, so it stops before the first epoch."""
    small = tmp_path / "small"
    if not mount_tmpfs(small, "1M"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        done = run_launch(
            FAST
            + [
                "mdl.members_per_fit=all",
                "width=256",
                "model.base_width=256",
                f"paths.output_root={small}",
                f"paths.cache_dir={tmp_path / 'cache'}",
            ],
            cwd=tmp_path,
        )
    finally:
        subprocess.run(["umount", str(small)], check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "not enough room" in done.stderr and "paths.output_root" in done.stderr and "Traceback" not in done.stderr
    assert not list(small.glob("**/*.ckpt"))  # stopped before training


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "full", "read-only"])
def test_bad_output_root_is_reported_before_hydra_writes(tmp_path: Path, kind: str) -> None:
    """A regular file, a full file system or a read-only one as paths.output_root: one message, exit 2,
    from the check that runs before Hydra creates the run folder (Hydra's own mkdir gave a traceback)."""
    root = tmp_path / "root"
    if kind == "file":
        root.write_text("not a folder")
        words = "is a file, not a folder"
    else:
        if not mount_tmpfs(root, "64k" if kind == "full" else "1M"):
            pytest.skip("needs root to mount a small tmpfs")
        if kind == "full":
            subprocess.run(["dd", "if=/dev/zero", f"of={root / 'fill'}", "bs=1k", "count=128"], capture_output=True)
            words = "the disk is full"
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
            words = "not writable"
    try:
        for multirun in ([], ["-m", "seed=0,1"]):
            done = run_launch(multirun[:1] + FAST + multirun[1:] + [f"paths.output_root={root}"], cwd=tmp_path)
            assert done.returncode == 2, done.stderr[-2000:]
            assert words in done.stderr and "paths.output_root" in done.stderr and "Traceback" not in done.stderr
    finally:
        if kind != "file":
            subprocess.run(["umount", str(root)], check=False)


def test_safetensors_own_error_for_a_full_disk_is_raised_as_the_oserror_it_is(tmp_path: Path) -> None:
    """safetensors raises its own SafetensorError ("... (os error 28)") on a full disk, which the cache reports only
    as an OSError (tests/test_bad_inputs.py); other errors pass through as they are (a real full disk: below)."""
    from safetensors import SafetensorError

    from erasure.base import save_file_as_oserror

    def failing(err: Exception):
        def save_file(tensors, filename, metadata=None):
            raise err

        return save_file

    target = str(tmp_path / "x.safetensors")
    with pytest.raises(OSError) as raised:
        save_file_as_oserror(failing(SafetensorError("No space left on device (os error 28)")), {}, target, {})
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == target
    assert isinstance(raised.value.__cause__, SafetensorError)
    for other in (SafetensorError("header too large"), ValueError("a bug (os error 28)")):
        with pytest.raises(type(other)) as raised:
            save_file_as_oserror(failing(other), {}, target, {})
        assert raised.value is other


@pytest.mark.slow  # a launch on a real tmpfs (the same errors in process: the tests beside it)
def test_cache_on_a_real_full_disk_is_one_message(tmp_path: Path) -> None:
    """safetensors raises its own SafetensorError ("os error 28") on a full disk: reported as the cache's
    full disk with the settings that move or disable it, not as a traceback."""
    small = tmp_path / "small"
    if not mount_tmpfs(small, "64k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        done = run_launch(
            [*FAST, f"paths.output_root={tmp_path / 'out'}", f"data.cache_dir={small / 'erased'}"], cwd=tmp_path
        )
    finally:
        subprocess.run(["umount", str(small)], check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "erasure cache: cannot write to" in done.stderr and "the disk is full" in done.stderr
    assert "data.cache_dir=null" in done.stderr and "Traceback" not in done.stderr


def test_a_failing_logger_after_the_results_does_not_fail_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The results are written and the checkpoints removed before the logger runs; its failure is logged only."""

    def broken(*args, **kwargs):
        raise RuntimeError("W&B is down")

    monkeypatch.setattr(experiment, "log_results", broken)
    results = run_experiment(compose_config(STACKED, tmp_path), tmp_path / "run")
    assert results["paper_mdl"] > 0 and (tmp_path / "run" / "results.json").exists()
    assert not list((tmp_path / "store").glob("*/checkpoints/*.ckpt"))
