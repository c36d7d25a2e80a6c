"""Real file formats written small, read back through the exact code a user runs.

CIFAR-10: pickled batches as in cifar-10-python.tar.gz; SVHN: the .mat files (X as
(32, 32, 3, n), label 10 for digit 0); CIFARNet: a DatasetDict saved by ``save_to_disk`` with the
hub's columns (``img`` Image, ``label`` ClassLabel). Only the MD5 check is switched off
(``verify_checksums=False``), which the checksum test shows is on by default.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import available_sources, load_source
from datamodules.data_root import MissingDataError

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# --- writers of the real formats -------------------------------------------------------------


def write_cifar10(
    root: Path, per_batch: int = 3, n_test: int = 4, seed: int = 0
) -> tuple[np.ndarray, list[int], np.ndarray, list[int]]:
    """Write data_batch_1..5, test_batch and batches.meta; return the images (n, 3, 32, 32) and labels."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train_images, train_labels = [], []
    for b in range(1, 6):
        images = rng.integers(0, 256, (per_batch, 3, 32, 32), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        entry = {
            "batch_label": f"training batch {b} of 5",
            "labels": labels,
            "data": images.reshape(per_batch, 3072),
            "filenames": [f"img{b}_{i}.png" for i in range(per_batch)],
        }
        with open(folder / f"data_batch_{b}", "wb") as f:
            pickle.dump(entry, f)
        train_images.append(images)
        train_labels += labels
    test_images = rng.integers(0, 256, (n_test, 3, 32, 32), dtype=np.uint8)
    test_labels = rng.integers(0, 10, n_test).tolist()
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(
            {
                "batch_label": "testing batch 1 of 1",
                "labels": test_labels,
                "data": test_images.reshape(n_test, 3072),
                "filenames": [],
            },
            f,
        )
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": CIFAR_CLASSES, "num_cases_per_batch": per_batch, "num_vis": 3072}, f)
    return np.concatenate(train_images), train_labels, test_images, test_labels


def write_svhn(folder: Path, n: int, split: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Write {split}_32x32.mat as published: X (32, 32, 3, n) uint8, y (n, 1) in 1..10 (10 = digit 0)."""
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    X = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
    y = np.arange(1, n + 1).reshape(n, 1) % 10  # covers 0 -> stored as 10 below
    y[y == 0] = 10
    folder.mkdir(parents=True, exist_ok=True)
    savemat(folder / f"{split}_32x32.mat", {"X": X, "y": y.astype(np.uint8)})
    return X, y


# --- CIFAR-10 --------------------------------------------------------------------------------


def test_cifar10_real_format_round_trip(tmp_path: Path) -> None:
    train_images, train_labels, test_images, test_labels = write_cifar10(tmp_path)
    src = load_source("cifar10", root=str(tmp_path), verify_checksums=False)
    assert src.classes == CIFAR_CLASSES
    assert src.train.x.shape == (15, 3, 32, 32) and src.test.x.shape == (4, 3, 32, 32)
    assert src.train.x.dtype == torch.float32 and src.train.y.dtype == torch.int64
    assert 0.0 <= float(src.train.x.min()) and float(src.train.x.max()) <= 1.0
    # pixel order: channel-major rows of 1024 (R, G, B), each row-major 32x32, batches in order 1..5
    assert torch.equal((src.train.x * 255).round().to(torch.uint8), torch.from_numpy(train_images))
    assert torch.equal((src.test.x * 255).round().to(torch.uint8), torch.from_numpy(test_images))
    assert src.train.y.tolist() == train_labels and src.test.y.tolist() == test_labels
    # the red plane of image 0 is the first 1024 bytes of its row, read row by row
    row = train_images[0].reshape(3072)
    assert np.array_equal((src.train.x[0, 0] * 255).round().byte().numpy(), row[:1024].reshape(32, 32))


def test_cifar10_checks_md5_by_default(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    with pytest.raises(RuntimeError, match="verify_checksums=false"):
        load_source("cifar10", root=str(tmp_path))


def test_cifar10_missing_names_path_and_fix(tmp_path: Path) -> None:
    with pytest.raises(MissingDataError) as err:
        load_source("cifar10", root=str(tmp_path / "nowhere"))
    message = str(err.value)
    assert str(tmp_path / "nowhere" / "cifar-10-batches-py") in message
    assert "data.options.download=true" in message and "SLOWING_DATA_ROOT" in message


# --- SVHN ------------------------------------------------------------------------------------


def test_svhn_real_format_round_trip(tmp_path: Path) -> None:
    X_train, y_train = write_svhn(tmp_path / "svhn", 12, "train", seed=1)
    X_test, y_test = write_svhn(tmp_path / "svhn", 5, "test", seed=2)
    src = load_source("svhn", root=str(tmp_path), verify_checksums=False)
    assert src.train.x.shape == (12, 3, 32, 32) and src.test.x.shape == (5, 3, 32, 32)
    assert src.train.x.dtype == torch.float32 and src.train.y.dtype == torch.int64
    # x[i, c, h, w] == X[h, w, c, i]
    expected = torch.from_numpy(X_train).permute(3, 2, 0, 1)
    assert torch.equal((src.train.x * 255).round().to(torch.uint8), expected)
    assert torch.equal((src.test.x * 255).round().to(torch.uint8), torch.from_numpy(X_test).permute(3, 2, 0, 1))
    # label 10 means digit 0; all labels in 0..9
    assert src.train.y.tolist() == [int(v) % 10 for v in y_train.ravel()]
    assert int(src.train.y.min()) == 0 and int(src.train.y.max()) == 9
    assert src.num_classes == 10


def test_svhn_missing_names_path_and_fix(tmp_path: Path) -> None:
    with pytest.raises(MissingDataError, match="train_32x32.mat") as err:
        load_source("svhn", root=str(tmp_path))
    assert str(tmp_path / "svhn") in str(err.value) and "data.options.download=true" in str(err.value)


def test_svhn_checks_md5_by_default(tmp_path: Path) -> None:
    write_svhn(tmp_path / "svhn", 3, "train", seed=0)
    write_svhn(tmp_path / "svhn", 3, "test", seed=1)
    with pytest.raises(RuntimeError, match="MD5"):
        load_source("svhn", root=str(tmp_path))


# --- CIFARNet --------------------------------------------------------------------------------


def write_cifarnet(folder: Path, n_train: int, n_test: int, seed: int) -> dict[str, tuple[np.ndarray, list[int]]]:
    """A tiny DatasetDict with the hub's schema; the first train image is greyscale (as some are)."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    features = Features({"img": Image(), "label": ClassLabel(names=CIFAR_CLASSES)})
    written, splits = {}, {}
    for split, n in (("train", n_train), ("test", n_test)):
        arrays = rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)
        if split == "train":
            arrays[0] = arrays[0, :, :, :1]  # grey: all channels equal
        images = [
            PILImage.fromarray(a[:, :, 0], mode="L") if (split == "train" and i == 0) else PILImage.fromarray(a)
            for i, a in enumerate(arrays)
        ]
        labels = rng.integers(0, 10, n).tolist()
        splits[split] = Dataset.from_dict({"img": images, "label": labels}, features=features)
        written[split] = (arrays, labels)
    DatasetDict(splits).save_to_disk(str(folder))
    return written


def test_cifarnet_saved_copy_round_trip(tmp_path: Path) -> None:
    written = write_cifarnet(tmp_path / "cifarnet", 6, 3, seed=3)
    src = load_source("cifarnet", root=str(tmp_path))
    assert src.classes == CIFAR_CLASSES
    for name, images in (("train", src.train), ("test", src.test)):
        arrays, labels = written[name]
        assert images.x.shape == (len(labels), 3, 64, 64) and images.x.dtype == torch.float32
        assert images.y.dtype == torch.int64 and images.y.tolist() == labels
        # (n, h, w, c) as written -> (n, c, h, w); PNG is lossless, so pixels are exact
        assert torch.equal((images.x * 255).round().to(torch.uint8), torch.from_numpy(arrays).permute(0, 3, 1, 2))
    assert torch.equal(src.train.x[0, 0], src.train.x[0, 2])  # the grey image became RGB


def test_cifarnet_explicit_path_and_missing_message(tmp_path: Path) -> None:
    write_cifarnet(tmp_path / "elsewhere", 2, 2, seed=4)
    assert len(load_source("cifarnet", root=str(tmp_path), path=str(tmp_path / "elsewhere")).train) == 2
    with pytest.raises(MissingDataError) as err:
        load_source("cifarnet", root=str(tmp_path / "empty"))
    assert str(tmp_path / "empty" / "cifarnet") in str(err.value)
    assert "data.options.download=true" in str(err.value) and "save_to_disk" in str(err.value)


# --- registry and config ---------------------------------------------------------------------


def test_every_source_is_registered() -> None:
    assert {"digits", "cifar10", "svhn", "cifarnet", "synthetic"} <= set(available_sources())


ONE_SOURCE = """
import sys
from datamodules import available_sources, load_source
from datamodules.sources import SHIPPED
load_source("digits")
print(len(available_sources()), sorted(m for m in set(SHIPPED.values()) if m in sys.modules))
load_source("synthetic", n_train=20, n_test=10)
print("datamodules.synthetic" in sys.modules)
"""


@pytest.mark.slow
def test_a_run_imports_only_its_own_sources_code_and_every_name_is_listed() -> None:
    """datamodules.sources.SHIPPED: a source's module is imported when its name is first used, so a digits run
    imports none of the CIFAR, SVHN or synthetic loaders; every shipped name is listed before that."""
    from conftest import run_python

    proc = run_python(ONE_SOURCE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["7 []", "True"], proc.stdout


@pytest.mark.parametrize("name", ["cifar10", "svhn", "cifarnet", "synthetic"])
def test_data_configs_mirror_digits(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each conf/data yaml has the keys of digits.yaml, names its source, and roots data in the env var."""
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf"
    digits = OmegaConf.load(conf / "data" / "digits.yaml")
    cfg = OmegaConf.load(conf / "data" / f"{name}.yaml")
    assert set(digits) <= set(cfg), f"{name}.yaml lacks {set(digits) - set(cfg)}"
    assert cfg.source == name
    if name != "synthetic":
        monkeypatch.setenv("SLOWING_DATA_ROOT", str(tmp_path))
        paths = OmegaConf.load(conf / "paths" / "default.yaml")
        full = OmegaConf.create({"paths": paths, "data": cfg})
        assert full.data.options.root == str(tmp_path)
        assert full.data.options.download is False


@pytest.mark.parametrize(
    "name, options",
    [
        ("digits", {}),
        ("synthetic", {"shape": [2, 3, 3], "n_train": 50, "n_test": 20}),
        ("single_index", {"d": 5, "n_train": 40, "n_test": 10}),
        ("multiscale_linear", {"d": 6, "p": 3, "n_train": 40, "n_test": 0}),
    ],
)
def test_a_source_declares_the_bytes_it_loads(name: str, options: dict) -> None:
    """What a packed sweep sizes its packs by (mdl.run.pack.plan_packs), known without loading, is what loading
    gives: every split's float32 images and int64 labels."""
    from datamodules.sources import declared_bytes

    source = load_source(name, **options)
    loaded = sum(t.nbytes for s in (source.train, source.test) if s is not None for t in (s.x, s.y))
    assert declared_bytes(name, options) == loaded
