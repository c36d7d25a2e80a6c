"""Every bad input ends in one message naming the setting or the file and the fix: never a raw
traceback from deep inside, never silently wrong numbers. In-process checks of each guard, and
(slow) the end-to-end probe, scripts/probe_bad_inputs.py, which runs them through launch.py."""

from __future__ import annotations

import builtins
import errno
import os
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from conftest import FAST, REPO, compose_config
from datamodules import load_source
from datamodules.cache import CacheWriteError, ErasureCache, cache_key, remove_stale_temporaries
from datamodules.data_root import BadDataError, UnreadableDataError
from datamodules.datamodule import ErasedDataModule
from datamodules.options import DataOptions
from datamodules.sources import ImageSet, ImageSource, check_labels
from erasure import erasure_report, fit_eraser
from erasure.diagnostics import erasure_shortfall
from erasure.linalg import NoVarianceError
from mdl.run.config_checks import validate_config
from scripts.probe_bad_inputs import bad_label, directory_instead_of_file, reshape_batch, truncate, write_cifar10


def synthetic_module(tmp_path: Path | None = None, eraser: dict | None = None, **overrides) -> ErasedDataModule:
    """A small synthetic data module on the CPU (no cache unless a folder is given)."""
    options = {"num_classes": 3, "shape": [1, 4, 4], "n_train": 400, "n_test": 100, "mean_shift": 2.0}
    options |= overrides.pop("options", {})
    settings = {"val_size": 100, "test_size": 0, "device": "cpu", "cache_dir": str(tmp_path) if tmp_path else None}
    data = {"source": "synthetic", "options": options, **(settings | overrides)}
    return ErasedDataModule(DataOptions.from_config(data, eraser or {"name": "leace", "options": {}}))


# --- sizes and names, refused before anything is loaded ---------------------------------------


@pytest.mark.parametrize(
    "override, named",
    [
        ("data.val_size=0", "data.val_size=0"),
        ("data.batch_size=0", "data.batch_size=0"),
        ("data.eval_batch_size=0", "data.eval_batch_size=0"),
        ("data.test_size=-1", "data.test_size=-1"),
        ("width=0", "width=0"),
        ("depth=0", "depth=0"),
        ("mdl.num_blocks=0", "mdl.num_blocks=0"),
        ("mdl.first_block=0", "mdl.first_block=0"),
        ("trainer.kwargs.max_epochs=0", "trainer.kwargs.max_epochs=0"),
        ("data.qda_regularization=0", "data.qda_regularization=0"),
        ("data.source=nope", "data.source"),
    ],
)
def test_validate_config_names_the_setting(override: str, named: str) -> None:
    with pytest.raises(ValueError) as err:
        validate_config(compose_config(FAST + [override]))
    message = str(err.value)
    assert named in message and ("e.g." in message or "choose one of" in message)


def test_validate_config_accepts_the_defaults_and_fast_settings() -> None:
    validate_config(compose_config(FAST))
    validate_config(compose_config(FAST + ["data=cifar10", "model.base_width=null", "trainer.kwargs.max_epochs=-1"]))


@pytest.mark.parametrize("setting", ["val_size", "batch_size", "eval_batch_size"])
def test_data_module_refuses_zero_sizes(setting: str) -> None:
    with pytest.raises(ValueError, match=f"data.{setting}=0: must be an integer >= 1"):
        synthetic_module(**{setting: 0})


def test_held_out_splits_must_leave_training_data() -> None:
    dm = synthetic_module(val_size=400)
    with pytest.raises(ValueError, match=r"data.val_size = 400 leaves no training examples out of the 400"):
        dm.setup()


# --- data files: unreadable, damaged, re-shaped, labels out of range ---------------------------


@pytest.fixture
def cifar_folder(tmp_path: Path) -> Path:
    return write_cifar10(tmp_path, per_batch=3, n_test=4)


def load_cifar(folder: Path):
    return load_source("cifar10", root=str(folder.parent), verify_checksums=False)


def test_unreadable_batch_names_the_file_and_the_fix(cifar_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = cifar_folder / "data_batch_3"
    real_open = builtins.open

    def deny(file, *args, **kwargs):  # tests run as root, where chmod does not bite
        if Path(file) == target:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(UnreadableDataError) as err:
        load_cifar(cifar_folder)
    assert str(target) in str(err.value) and "chmod" in str(err.value) and "paths.data_root" in str(err.value)


def test_unreadable_folder_names_it(cifar_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_exists = Path.exists

    def deny(self: Path) -> bool:
        if self.parent == cifar_folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(cifar_folder))
        return real_exists(self)

    monkeypatch.setattr(Path, "exists", deny)
    with pytest.raises(PermissionError, match=f"cannot read {cifar_folder} "):
        load_cifar(cifar_folder)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads files whatever their mode")
def test_chmod_unreadable_batch(cifar_folder: Path) -> None:
    (cifar_folder / "test_batch").chmod(0)
    with pytest.raises(UnreadableDataError, match="test_batch"):
        load_cifar(cifar_folder)


@pytest.mark.parametrize(
    "damage, file, words",
    [
        (truncate, "data_batch_2", "truncated"),
        (reshape_batch, "data_batch_4", "3072"),
        (directory_instead_of_file, "data_batch_1", "not a regular file"),
        (bad_label, "test_batch", "outside 0..9"),
        (bad_label, "data_batch_5", "outside 0..9"),
    ],
)
def test_damaged_batch_names_the_file(cifar_folder: Path, damage, file: str, words: str) -> None:
    damage(cifar_folder / file)
    with pytest.raises(BadDataError) as err:
        load_cifar(cifar_folder)
    message = str(err.value)
    assert f"{cifar_folder / file}" in message and words in message and "download=true" in message


def test_checksum_mismatch_is_a_value_error_for_launch(cifar_folder: Path) -> None:
    """launch.py reports ValueErrors as one message; torchvision callers expect a RuntimeError."""
    with pytest.raises(ValueError, match="verify_checksums=false") as err:
        load_source("cifar10", root=str(cifar_folder.parent))
    assert isinstance(err.value, RuntimeError)


def test_bad_label_stops_the_data_module_at_load_time(cifar_folder: Path) -> None:
    """A label 10 in a training batch could land in the validation split, where no eraser checks it."""
    bad_label(cifar_folder / "data_batch_5", label=-1)
    data = {
        "source": "cifar10",
        "options": {"root": str(cifar_folder.parent), "verify_checksums": False},
        "val_size": 3,
        "test_size": 0,
        "device": "cpu",
    }
    dm = ErasedDataModule(DataOptions.from_config(data, {"name": "none", "options": {}}))
    with pytest.raises(BadDataError, match="data_batch_5.*outside 0..9.*#0: -1"):
        dm.setup()


def test_svhn_damaged_file_and_bad_label(tmp_path: Path) -> None:
    from test_sources import write_svhn

    write_svhn(tmp_path / "svhn", 12, "train", seed=1)
    write_svhn(tmp_path / "svhn", 5, "test", seed=2)
    truncate(tmp_path / "svhn" / "test_32x32.mat")
    with pytest.raises(BadDataError, match="test_32x32.mat"):
        load_source("svhn", root=str(tmp_path), verify_checksums=False)

    from scipy.io import savemat

    X = np.zeros((32, 32, 3, 4), dtype=np.uint8)
    savemat(tmp_path / "svhn" / "test_32x32.mat", {"X": X, "y": np.array([[1], [2], [11], [10]], dtype=np.uint8)})
    with pytest.raises(BadDataError, match=r"test_32x32.mat.*outside 0..9.*#2: 11"):
        load_source("svhn", root=str(tmp_path), verify_checksums=False)


def test_cifarnet_label_out_of_range_names_the_split(tmp_path: Path) -> None:
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image
    from PIL import Image as PILImage

    features = Features({"img": Image(), "label": ClassLabel(names=["a", "b"])})
    image = PILImage.fromarray(np.zeros((64, 64, 3), dtype=np.uint8))
    splits = {
        s: Dataset.from_dict({"img": [image, image], "label": labels}, features=features)
        for s, labels in (("train", [0, 1]), ("test", [1, -1]))
    }
    DatasetDict(splits).save_to_disk(str(tmp_path / "cifarnet"))
    with pytest.raises(BadDataError, match=r"cifarnet/test.*outside 0..1"):
        load_source("cifarnet", root=str(tmp_path))


def test_labels_must_be_integers() -> None:
    with pytest.raises(BadDataError, match="integer class indices"):
        check_labels(torch.tensor([0.0, 1.0]), 2, "somewhere", "fix it")


@pytest.mark.parametrize(
    "x, words",
    [(torch.full((6, 1, 2, 2), float("nan")), "NaN or infinite"), (torch.full((6, 1, 2, 2), 0.5), "identical")],
)
def test_every_source_is_checked(x: torch.Tensor, words: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import datamodules.sources as sources

    source = ImageSource(name="odd", train=ImageSet(x, torch.arange(6) % 2), test=None, classes=["a", "b"])
    monkeypatch.setitem(sources._SOURCES, "odd", lambda **_: source)
    with pytest.raises(BadDataError, match=f"data source 'odd', train split.*{words}|'odd'.*{words}"):
        load_source("odd")


# --- data without variance --------------------------------------------------------------------


@pytest.mark.parametrize("option, value", [("std", 1e-30), ("center", float("nan")), ("std", float("nan"))])
def test_synthetic_options_that_give_no_data(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"data.options.{option}"):
        load_source("synthetic", **{option: value})


@pytest.mark.parametrize("name", ["leace", "qleace", "alf_qleace"])
def test_erasers_refuse_data_without_variance(name: str) -> None:
    x, y = torch.full((20, 6), 0.5, dtype=torch.float64), torch.arange(20) % 2
    with pytest.raises(NoVarianceError, match="zero variance in every direction"):
        fit_eraser(name, x, y)


@pytest.mark.parametrize("name", ["leace", "qleace"])
def test_rank_warning_survives_a_single_kept_direction(name: str) -> None:
    """Formatting the rank warning must not crash however few directions are kept."""
    x = torch.zeros(40, 5, dtype=torch.float64)
    x[:, 0] = torch.linspace(0, 1, 40)
    with pytest.warns(RuntimeWarning, match="rank 1 of 5|span 1 of 5"):
        fit_eraser(name, x, torch.arange(40) % 2)


# --- diagnostics degrade, and say so ------------------------------------------------------------


def test_qda_probe_with_five_samples_per_class_is_skipped_not_fatal() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(10, 1, 8, 8, generator=g), torch.arange(10) % 2
    x_test, y_test = torch.rand(6, 1, 8, 8, generator=g), torch.arange(6) % 2
    skipped: dict[str, str] = {}
    with pytest.warns(RuntimeWarning, match="probe result.*skipped"):
        report = erasure_report(
            x, x, y, x_test, x_test, y_test, skipped=skipped, max_features=9
        )  # more dims than samples
    assert "qda_acc_before" not in report and "qda_acc_before" in skipped and "samples" in skipped["qda_acc_before"]
    assert "linear_probe_acc_before" in report and "max_mean_gap_after" in report


def test_data_module_records_skipped_probes(tmp_path: Path) -> None:
    dm = synthetic_module(
        tmp_path, options={"num_classes": 3, "n_train": 16, "n_test": 10}, val_size=12
    )  # 4 rows, 3 classes
    with pytest.warns(RuntimeWarning, match="skipped"):
        dm.setup()
    assert "qda_acc_before" in dm.diagnostics["erasure_skipped"]
    assert all(isinstance(v, float) for v in dm.diagnostics["erasure"].values())  # loggable as metrics


def test_erasure_shortfall() -> None:
    before = {"max_mean_gap": 1.687, "max_cov_gap": 2.0}
    assert erasure_shortfall(before, {"max_mean_gap": 1.687, "max_cov_gap": 0.1}, ("max_mean_gap", "max_cov_gap")) == [
        "max_mean_gap 1.687 -> 1.687"
    ]
    assert erasure_shortfall(before, {"max_mean_gap": 1e-9, "max_cov_gap": 2.0}, ("max_mean_gap",)) == []
    assert (
        erasure_shortfall({"max_mean_gap": 1e-9}, {"max_mean_gap": 1e-9}, ("max_mean_gap",)) == []
    )  # nothing to erase


def test_gradient_eraser_that_did_not_erase_warns(tmp_path: Path) -> None:
    options = {"steps": 1, "value_range": None, "log_every": 0}
    dm = synthetic_module(tmp_path, eraser={"name": "gradient", "options": options})
    with pytest.warns(
        RuntimeWarning, match=r"'gradient' eraser did not erase on the training split.*eraser.options.steps \(now 1\)"
    ):
        dm.setup()
    assert any("val split" in m for m in dm.diagnostics["not_erased"])
    again = synthetic_module(tmp_path, eraser={"name": "gradient", "options": options})
    with pytest.warns(RuntimeWarning, match="did not erase"):  # a cache hit warns as well
        again.setup()


def test_working_eraser_does_not_warn(tmp_path: Path) -> None:
    dm = synthetic_module(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup()
    assert not [w for w in caught if "did not erase" in str(w.message)]
    assert dm.diagnostics["not_erased"] == []


# --- settings that used to be accepted and ignored, or fail late --------------------------------


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["+data.options.foo=1"], "data.options.foo"),
        (["+data.batch_sise=64"], "did you mean data.batch_size"),
        (["data=synthetic", "+data.options.n_tset=5"], "did you mean data.options.n_test"),
        (["trainer.compile=foo"], "trainer.compile='foo'"),
        (["trainer.precision=fp16"], "trainer.precision"),
    ],
)
def test_unknown_option_or_backend_is_refused_before_loading(overrides: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")):
        validate_config(compose_config(FAST + overrides))


@pytest.mark.slow
def test_every_shipped_data_config_passes_the_option_check() -> None:
    for path in sorted(p for p in (REPO / "conf" / "data").glob("*.yaml") if not p.stem.startswith("_")):
        validate_config(compose_config(FAST + [f"data={path.stem}"]))


@pytest.mark.parametrize("source", ["single_index", "multiscale_linear"])
def test_teacher_student_without_a_test_split(source: str) -> None:
    """n_test=0: no official test split (the data module holds data.test_size out instead)."""
    loaded = load_source(source, n_train=50, n_test=0)
    assert loaded.test is None and len(loaded.train) == 50


def test_covariance_power_that_overflows_names_the_setting(tmp_path: Path) -> None:
    """digits' covariance spans 2e-6..0.7: its 25th inverse power overflows float64."""
    data = {
        "source": "digits",
        "val_size": 100,
        "test_size": 100,
        "device": "cpu",
        "transform": {"name": "covariance_power", "p": -50, "eps": 1e-6, "order": "before_eraser"},
    }
    dm = ErasedDataModule(DataOptions.from_config(data, {"name": "leace", "options": {}}))
    with pytest.raises(ValueError, match=r"data\.transform.*p=-50.*closer to 0"):
        dm.setup()


@pytest.mark.slow
def test_download_without_network_says_how_to_get_the_files(tmp_path: Path) -> None:
    """A real download through a proxy that refuses every connection, as a node without network does."""
    script = "from datamodules import load_source; load_source('cifar10', root=r'%s', download=True)" % (
        tmp_path / "data"
    )
    env = {
        **os.environ,
        "https_proxy": "http://127.0.0.1:9",
        "http_proxy": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "no_proxy": "",
        "NO_PROXY": "",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()
    message = "\n".join(last[-4:])
    assert "MissingDataError" in message and "cifar-10-python.tar.gz" in message and "by hand" in message, done.stderr


def test_download_errors_that_are_not_the_network_pass_through() -> None:
    from datamodules.data_root import MissingDataError, downloading

    with pytest.raises(MissingDataError, match="by hand: copy it"):
        with downloading("x", "http://example/x", "copy it"):
            import urllib.error

            raise urllib.error.URLError("Name or service not known")
    with pytest.raises(KeyError):
        with downloading("x", "http://example/x", "copy it"):
            raise KeyError("a bug, not the network")


# --- the cache: dead writers' temporaries, unwritable folders ------------------------------------


def make_data(calls: list[int]):
    def build():
        calls.append(1)
        return {"x": torch.arange(1000.0)}, {}

    return build


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_stale_temporaries_are_removed_on_next_access(tmp_path: Path) -> None:
    key = cache_key(what="stale")
    stale = tmp_path / f".{key}.data.safetensors.12345.abcd.tmp"
    fresh = tmp_path / f".{key}.data.safetensors.12346.efgh.tmp"
    old_style = tmp_path / f".{key}.eraser.safetensors.ijkl.raw"
    for path in (stale, fresh, old_style):
        path.write_bytes(b"\0" * 4096)
    age(stale, 2 * 3600)
    age(old_style, 2 * 3600)
    with pytest.warns(RuntimeWarning, match="removed 2 temporary file"):
        ErasureCache(tmp_path).tensors(key, make_data([]))
    assert not stale.exists() and not old_style.exists() and fresh.exists()


@contextmanager
def lock_held_elsewhere(lock: Path) -> Iterator[None]:
    """Another process holds ``lock`` (a cache writer at work) while the block runs."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from filelock import FileLock; l = FileLock(sys.argv[1]); "
            "l.acquire(); print('held', flush=True); time.sleep(60)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_locked_temporaries_are_kept(tmp_path: Path) -> None:
    key = cache_key(what="locked")
    temp = tmp_path / f".{key}.data.safetensors.999.zz.tmp"
    temp.write_bytes(b"partial")
    age(temp, 2 * 3600)
    with lock_held_elsewhere(tmp_path / f"{key}.data.safetensors.lock"):
        assert remove_stale_temporaries(tmp_path) == []
        assert temp.exists()
    assert remove_stale_temporaries(tmp_path) == [temp]


def test_safetensors_own_temporaries_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    """safetensors' ``save_file`` writes ``.tmpXXXXXX`` next to its target: a kill during a cache write left that
    file (75 MB for a CIFAR split) for ever. Removed on the next start when no writer holds a key of the folder, and
    kept while one does (it may be that writer's) unless it is stale."""
    key = cache_key(what="killed")
    left = tmp_path / ".tmpPEccnQ"
    left.write_bytes(b"\0" * 4096)
    with lock_held_elsewhere(tmp_path / f"{key}.data.safetensors.lock"):
        assert remove_stale_temporaries(tmp_path) == [] and left.exists()
    with pytest.warns(RuntimeWarning, match="removed 1 temporary file"):
        ErasureCache(tmp_path).tensors(key, make_data([]))
    assert not left.exists()


def test_temporary_names_carry_the_writer_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    names: list[str] = []
    real_save = safetensors.torch.save_file
    monkeypatch.setattr(
        safetensors.torch,
        "save_file",
        lambda t, f, metadata=None: (names.append(f), real_save(t, f, metadata=metadata)),
    )
    ErasureCache(tmp_path).tensors(cache_key(what="pid"), make_data([]))
    assert len(names) == 1 and f".{os.getpid()}." in Path(names[0]).name


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_unwritable_cache_names_the_folder_and_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    import safetensors.torch

    def fail(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError(code, os.strerror(code), filename)

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    calls: list[int] = []
    with pytest.raises(CacheWriteError) as err:
        ErasureCache(tmp_path).tensors(cache_key(what="full"), make_data(calls))
    message = str(err.value)
    assert str(tmp_path) in message and "data.cache_dir=null" in message and "data.cache_dir=" in message
    assert isinstance(err.value, OSError)  # launch.py reports OSErrors as one message
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []  # partial files removed


def test_unwritable_cache_fails_before_the_build(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    calls: list[int] = []
    with pytest.raises(CacheWriteError, match="data.cache_dir=null"):
        ErasureCache(blocker / "erased").tensors(cache_key(what="blocked"), make_data(calls))
    assert calls == []  # the (possibly hours-long) fit never started


# --- end to end -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_probe_script_every_bad_input_ends_in_one_message() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "probe_bad_inputs.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_nan_setting_is_reported_by_its_check_not_by_the_run_store(tmp_path: Path) -> None:
    """The run store's config record writes a NaN setting as text; the data source's check names it."""
    from mdl.run.experiment import run_experiment

    cfg = compose_config(FAST + ["data=synthetic", "data.options.center=nan"], tmp_path)
    with pytest.raises(ValueError, match="data.options.center"):
        run_experiment(cfg, tmp_path / "run")
