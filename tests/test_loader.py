"""The device-resident batch path: per-image crops and flips that are correct, varied and
reproducible, no host traffic per batch, and the two erase/augment orders and eval-label modes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from conftest import RecordOps, cuda_only, host_reads
from datamodules.augment import Augmentation, apply_crop_flip, crop_flip_params, crop_padding
from datamodules.datamodule import ErasedDataModule
from datamodules.options import DataOptions
from datamodules.stacked_batches import Pacing, StackedBatches, TrainSource
from erasure import Eraser, available_erasers, register_eraser

DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only())]


def images(n: int = 64, c: int = 3, side: int = 16, seed: int = 0, device: str = "cpu") -> Tensor:
    return torch.rand(n, c, side, side, generator=torch.Generator().manual_seed(seed)).to(device)


def one_member(x: Tensor, y: Tensor, batch: int, **options: Any) -> StackedBatches:
    """The training batches of a fit of one member on all of (x, y) (a stack of one)."""
    return StackedBatches([TrainSource(x, y)], [len(y)], batch, **options)


def epoch(loader: StackedBatches, number: int = 0) -> list[tuple[Tensor, Tensor]]:
    """One member's batches of epoch ``number``, the padding of the last one left out."""
    loader.streams[0].load_state_dict({"epoch": number, "step": 0})
    out = []
    for group in loader:
        for step in range(group.steps):
            real = group.weight[step, 0] > 0
            out.append((group.x[step, 0][real], group.y[step, 0][real]))
    return out


# --- augmentation --------------------------------------------------------------------------


def test_padding_follows_the_paper() -> None:
    assert [crop_padding(s, 0.125) for s in (8, 32, 64)] == [1, 4, 8]


def test_each_image_is_its_own_crop_and_flip() -> None:
    """Every output image equals a plain slice of its zero-padded input at its offsets (mirrored if flipped)."""
    x = images(32, side=12)
    pad = crop_padding(12, 0.125)
    params = crop_flip_params(32, pad, pad, True, torch.Generator().manual_seed(1), x.device)
    out = apply_crop_flip(x, params, pad, pad)
    padded = F.pad(x, (pad, pad, pad, pad))
    for i in range(32):
        dy, dx = int(params.dy[i]), int(params.dx[i])
        expected = padded[i, :, dy : dy + 12, dx : dx + 12]
        if params.flip[i]:
            expected = expected.flip(-1)
        assert torch.equal(out[i], expected), i
    assert 0 < int(params.flip.sum()) < 32  # both kinds occur


def test_augmentation_differs_between_images_of_one_batch() -> None:
    """One image repeated 64 times comes out as many different crops/flips."""
    x = images(1, side=16).expand(64, -1, -1, -1).contiguous()
    pad = crop_padding(16, 0.125)
    out = apply_crop_flip(x, crop_flip_params(64, pad, pad, True, torch.Generator().manual_seed(0), x.device), pad, pad)
    distinct = {tuple(img.flatten().tolist()) for img in out}
    assert len(distinct) > 20


def test_protocol_original_draws_one_crop_and_flip_per_batch() -> None:
    """augment_per_batch (protocol=original, torchvision v2 on a batch tensor): every image of a batch has the
    batch's one crop offset and flip; batches draw their own, and the default draws per image."""
    x = images(1, side=16).expand(64, -1, -1, -1).contiguous()
    y = torch.zeros(64, dtype=torch.long)
    per_batch = one_member(x, y, 16, augment=Augmentation(per_batch=True), seeds=3)
    batches = [xb for xb, _ in epoch(per_batch)]
    assert all(torch.equal(xb[i], xb[0]) for xb in batches for i in range(16))
    assert len({tuple(xb[0].flatten().tolist()) for xb in batches}) > 1
    per_image = epoch(one_member(x, y, 16, augment=Augmentation(), seeds=3))[0][0]
    assert len({tuple(img.flatten().tolist()) for img in per_image}) > 1


def test_protocol_original_keeps_the_prefix_order() -> None:
    """reshuffle False (protocol=original): the same order every epoch, the prefix's own."""
    x, y = images(40), torch.arange(40)
    loader = one_member(x, y, 16, reshuffle=False, augment=Augmentation(per_batch=True), seeds=1)
    for number in (0, 5):
        assert torch.equal(torch.cat([yb for _, yb in epoch(loader, number)]), y)


@pytest.mark.parametrize("device", DEVICES)
def test_augmented_batches_are_reproducible_per_seed_and_epoch(device: str) -> None:
    x, y = images(100, device=device), torch.arange(100, device=device)

    def epoch_batches(seed: int, number: int) -> list[Tensor]:
        loader = one_member(x, y, 32, augment=Augmentation(), seeds=seed)
        return [torch.cat([xb.flatten(1), yb[:, None].to(xb.dtype)], 1) for xb, yb in epoch(loader, number)]

    first, again = epoch_batches(0, 3), epoch_batches(0, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], epoch_batches(0, 4)[0])
    assert not torch.equal(first[0], epoch_batches(1, 3)[0])


def test_loader_serves_every_example_once_per_epoch() -> None:
    x, y = images(70), torch.arange(70)
    batches = epoch(one_member(x, y, 32, seeds=5))
    assert len(batches) == 3
    ys = torch.cat([yb for _, yb in batches])
    assert sorted(ys.tolist()) == list(range(70))
    xs = torch.cat([xb for xb, _ in batches])
    assert torch.equal(xs, x[ys])  # no augmentation: the images themselves, matched to their labels


# --- no host traffic per batch -------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_no_host_reads_or_transfers_per_batch(device: str) -> None:
    """Iterating an augmented, shuffled epoch runs only ops on the data's device and never reads
    a value back to Python (``_local_scalar_dense`` is what .item(), .tolist() and bool() do).

    On a CUDA machine this also proves that no index, offset or image crosses to the host; on a
    CPU-only machine the device check is trivially met and the scalar-read check is the content.
    """
    x, y = images(256, device=device), torch.arange(256, device=device)
    loader = one_member(x, y, 64, augment=Augmentation(), seeds=0)
    pointer = x.data_ptr()
    with RecordOps() as record:
        batches = [(g.x, g.y) for g in loader]
    assert len(batches) == 4
    assert not host_reads(record), record.ops
    # a transfer (.to(other device), .cpu()) shows up as an op touching a second device
    stray = [(name, devs) for name, devs in record.ops if devs - {str(x.device)}]
    assert not stray, stray
    assert all(xb.device == x.device and yb.device == x.device for xb, yb in batches)
    assert loader.x.data_ptr() == pointer  # the resident split was neither copied nor moved


def test_an_epochs_crops_and_flips_are_drawn_at_once() -> None:
    """One shuffle and one draw of each crop/flip field per epoch, however many batches it has: a
    draw per batch would be tiny kernels between a GPU's steps (per model, in the stacked engine)."""
    x, y = images(256), torch.arange(256)
    for batch_size in (128, 16):
        loader = one_member(x, y, batch_size, augment=Augmentation(), seeds=0)  # epoch 0 drawn when made
        with RecordOps() as record:
            batches = list(loader)  # and epoch 1 once epoch 0's last batch is drawn
        draws = [name for name in record.kernels if "rand" in name]
        assert len(batches) == 256 // batch_size
        assert draws == ["aten.randperm.generator", *["aten.randint.low_generator"] * 3], draws


# --- erase/augment order and eval labels through the data module ----------------------------


if "test_class_shift" not in available_erasers():

    @register_eraser("test_class_shift")
    @dataclass(frozen=True)
    class ClassShift(Eraser):
        """A label-dependent eraser for tests: x -> x - mean_z + mean (equalises class means)."""

        requires_labels = True
        class_means: Tensor
        mean: Tensor
        dim: int
        num_classes: int

        @classmethod
        def fit(cls, x: Tensor, y: Tensor, num_classes: int, **options: Any) -> "ClassShift":
            means = torch.stack([x[y == z].double().mean(0) for z in range(num_classes)])
            return cls(class_means=means, mean=x.double().mean(0), dim=x.shape[1], num_classes=num_classes)

        def _erase(self, x: Tensor, y: Tensor | None) -> Tensor:
            assert y is not None
            return x.double() - self.class_means.to(x.device)[y] + self.mean.to(x.device)


SYNTHETIC = {"num_classes": 3, "shape": [1, 6, 6], "n_train": 600, "n_test": 300, "mean_shift": 1.5, "cov_shift": 0.5}


def data_module(eraser: str, **overrides: Any) -> ErasedDataModule:
    data = {
        "source": "synthetic",
        "options": SYNTHETIC,
        "val_size": 200,
        "test_size": 0,
        "batch_size": 50,
        "device": "cpu",
        "cache_dir": None,
        **overrides,
    }
    dm = ErasedDataModule(DataOptions.from_config(data, {"name": eraser, "options": {}}), seed=0)
    dm.setup()
    return dm


def test_augment_then_erase_erases_each_augmented_batch() -> None:
    before = data_module("leace", augment=True, augment_order="augment_then_erase")
    after = data_module("leace", augment=True, augment_order="erase_then_augment")
    raw_x, raw_y = before.train_set.x, before.train_set.y  # kept raw in this order
    plain = one_member(raw_x, raw_y, 50, augment=Augmentation(), seeds=0)
    served = [epoch(dm.stacked_train_loader([dm.num_train])) for dm in (before, after)]
    for (xa, ya), (xr, yr), (xe, _) in zip(served[0], epoch(plain), served[1]):
        assert torch.equal(ya, yr)
        assert torch.allclose(xa, before.eraser(xr), atol=1e-6)  # erase(augment(x)) with the same crops
        assert not torch.allclose(xa, xe, atol=1e-4)  # the orders differ (padding zeros get erased)
    # scoring blocks are erased too in augment_then_erase (but not augmented)
    xb, _ = next(iter(before.eval_loader(0, 50)))
    assert torch.allclose(xb, before.eraser(raw_x[:50]), atol=1e-6)
    assert torch.allclose(xb, after.train_set.x[:50], atol=1e-6)
    assert torch.equal(before.val_set.x, after.val_set.x)  # val/test are erased once in both orders


@pytest.mark.parametrize(("eraser", "reads_per_call"), [("leace", 0), ("qleace", 1)])
def test_augment_then_erase_reads_back_at_most_qleaces_class_counts_per_batch(eraser: str, reads_per_call: int) -> None:
    """Erasing each training batch skips the eraser's value checks (NaN, label range: the raw split
    passed them when the eraser was fitted). On a GPU each read stalls the host; QLEACE's one read
    is its batch's class counts. The stacked engine erases a whole group of steps at once."""
    dm = data_module(eraser, augment=True, augment_order="augment_then_erase")
    stacked = dm.stacked_train_loader([dm.num_train, dm.num_train // 2], pacing=Pacing(4))
    with RecordOps() as record:
        groups = [stacked.next(4) for _ in range(3)]
    assert len(host_reads(record)) == reads_per_call * len(groups), host_reads(record)


def test_eval_labels_true_vs_predicted() -> None:
    """predicted maps each val example with the QDA's class; rows where it is right match the
    true-label erasure exactly, rows where it is wrong do not."""
    true = data_module("test_class_shift", eval_labels=True)
    predicted = data_module("test_class_shift", eval_labels="predicted")
    assert torch.equal(true.train_set.x, predicted.train_set.x)  # training data always uses its labels
    same = (true.val_set.x - predicted.val_set.x).flatten(1).abs().amax(1) < 1e-6
    accuracy = predicted.diagnostics["qda_val_accuracy"]
    assert 0.5 < accuracy < 1.0  # informative, but imperfect on these overlapping classes
    assert abs(float(same.double().mean()) - accuracy) < 1e-9
    with pytest.raises(ValueError, match="eval_labels"):
        data_module("test_class_shift", eval_labels="maybe")


def test_eval_labels_do_not_matter_for_label_free_erasers() -> None:
    a = data_module("leace", eval_labels=True)
    b = data_module("leace", eval_labels="predicted")
    assert torch.equal(a.val_set.x, b.val_set.x) and "qda_val_accuracy" not in b.diagnostics
