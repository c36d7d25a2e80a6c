"""One owner of the training device, guarded on a CPU-only machine.

Lightning's strategy teardown moves the LightningModule to the CPU after every ``fit`` while the
data module keeps every split on the training device. On a GPU that once crashed the first block's
scoring. Here the teardown is made to move the module to the ``meta`` device (a device that is
not the data's, and holds no values): a driver that used the module where Lightning left it fails,
one that restores the best weights onto the training device gives the numbers of a normal run.
"""

from __future__ import annotations

import copy

from pathlib import Path

import pytest
import schedulefree
import torch
from lightning.pytorch.strategies.strategy import Strategy

from conftest import FITS, FAST, compose_config
from datamodules.augment import Augmentation
from mdl.engine.checkpoints import DamagedCheckpoint, RunCheckpointIO
from mdl.engine.device import training_device
from mdl.run.experiment import run_experiment
from models import create_model
from models.stacked_module import StackedClassifier
from models.stacking import StackedModel

NUMBERS = ("paper_mdl", "online_codelength_bits", "final_val_loss", "final_test_bits_per_example", "blocks")


@pytest.mark.parametrize(("engine", "fits"), [("sequential", 3), ("stacked", 1)])
def test_scoring_and_restore_do_not_trust_where_lightning_left_the_module(
    engine: str, fits: int, tmp_path: Path, monkeypatch
) -> None:
    """Two prefix fits and the final fit (sequential) or the one stacked fit are each moved away."""
    settings = [*FAST, FITS[engine]]
    reference = run_experiment(compose_config(settings, tmp_path / "ref"), tmp_path / "ref")
    original = Strategy.teardown
    moved = []

    def teardown_elsewhere(self: Strategy) -> None:
        original(self)
        if self.lightning_module is not None:
            self.lightning_module.to(torch.device("meta"))  # stands in for "the CPU, not the data's GPU"
            moved.append(True)

    monkeypatch.setattr(Strategy, "teardown", teardown_elsewhere)
    results = run_experiment(compose_config(settings, tmp_path / "moved"), tmp_path / "moved")
    assert len(moved) == fits
    for key in NUMBERS:
        assert results[key] == reference[key], key


def test_cuda_requested_without_one_names_the_setting(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device=cuda asks for a GPU.*device=cpu"):
        training_device("cuda")
    with pytest.raises(ValueError, match=r"data.device=cuda asks for a GPU"):
        training_device("auto", data_device="cuda")


def test_data_device_and_accelerator_must_agree(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"data.device=cuda contradicts device=cpu"):
        training_device("cpu", data_device="cuda")
    with pytest.raises(ValueError, match=r"trainer.kwargs.accelerator=cpu contradicts data.device"):
        training_device("cuda", data_device="cuda", accelerator="cpu")
    assert training_device("auto", data_device="cpu", accelerator="cpu") == torch.device("cpu")
    assert training_device("auto", data_device="auto") == torch.device("cuda")


@pytest.mark.parametrize(
    "override, message",
    [
        ("+trainer.kwargs.precision=bf16-mixed", "one switch, trainer.precision=bf16"),
        ("trainer.precision=fp16", "trainer.precision='fp16': choose one of fp32, bf16"),
        ("trainer.compile=3", "trainer.compile must be"),
        ("device=tpu", "device='tpu' is not a device|only cpu and cuda"),
        ("+trainer.kwargs.devices=2", "one device"),
    ],
)
def test_bad_device_and_precision_settings_are_refused_before_loading(
    tmp_path: Path, override: str, message: str
) -> None:
    cfg = compose_config([*FAST, override], tmp_path)
    with pytest.raises(ValueError, match=message):
        run_experiment(cfg, tmp_path / "run")


def test_bf16_scoring_is_close_to_fp32_and_summed_in_float64() -> None:
    torch.manual_seed(0)
    model = create_model("mlp", 16, 2, 10, (1, 8, 8), base_width=16)
    with torch.no_grad():
        model.head.weight.normal_()  # the muP readout starts at zero
    batches = [(torch.rand(8, 1, 8, 8), torch.randint(0, 10, (8,)))]
    sums = {}
    for precision in ("fp32", "bf16"):
        module = StackedClassifier(StackedModel([copy.deepcopy(model)]), torch.optim.SGD, 0.1, precision=precision)
        sums[precision] = module.loss_sums(module.eval_weights([0]), batches)[0]
    assert sums["bf16"].dtype == torch.float64
    assert torch.allclose(sums["bf16"], sums["fp32"], rtol=0.05) and not torch.equal(sums["bf16"], sums["fp32"])


def test_checkpoints_are_checksummed_and_load_onto_the_training_device(tmp_path: Path) -> None:
    io_plugin = RunCheckpointIO("cpu")
    path = tmp_path / "a.ckpt"
    io_plugin.save_checkpoint({"w": torch.arange(4.0), "epoch": 3}, path)
    assert list(tmp_path.iterdir()) == [path]  # the unique temporary was renamed away
    loaded = io_plugin.load_checkpoint(path)
    assert loaded["epoch"] == 3 and loaded["w"].device == torch.device("cpu")
    blob = bytearray(path.read_bytes())
    blob[-9:-1] = bytes(8)  # 8 flipped bytes in the payload
    path.write_bytes(bytes(blob))
    with pytest.raises(DamagedCheckpoint, match="checksum"):
        io_plugin.load_checkpoint(path)
    path.write_bytes(path.read_bytes()[:20])  # truncated
    with pytest.raises(DamagedCheckpoint):
        io_plugin.load_checkpoint(path)


def test_batch_transfer_hooks_move_batches_to_the_device_they_are_asked_for() -> None:
    """The module replaces Lightning's generic batch transfer with a direct one; it must still move
    a batch that is elsewhere (here to ``meta``, which a batch returned unchanged would not be on)."""
    from datamodules.stacked_batches import StackedBatch

    meta = torch.device("meta")
    x, y = torch.rand(4, 1, 8, 8), torch.randint(0, 10, (4,))
    stack = StackedClassifier(StackedModel([create_model("mlp", 16, 1, 10, (1, 8, 8))]), torch.optim.SGD, lr=0.1)
    group = stack.transfer_batch_to_device(
        StackedBatch(x[None, None], y[None, None], torch.ones(1, 1, 4), [0]), meta, 0
    )
    assert isinstance(group, StackedBatch) and group.members == [0]
    assert all(t.device == meta for t in (group.x, group.y, group.weight))


@pytest.mark.parametrize("name", ["mlp", "lenet"])  # the MLP's batched form; torch.func's vmap
def test_a_fit_trains_where_the_data_is(name: str, monkeypatch) -> None:
    """``meta`` stands in for a GPU: like CUDA it refuses to mix its tensors with CPU ones (0-dim
    ones aside) and holds no values to read, so a tensor made on the default device, or a read of a
    value, anywhere in batching, augmentation, a group of steps, the optimizer, a member leaving or
    the stacked validation sums fails here. Meta has no random generator: the epochs draw from the
    global one (placement is what is checked)."""
    from datamodules import stacked_batches
    from mdl.engine.stacked_fit import build_members

    monkeypatch.setattr(stacked_batches, "epoch_generator", lambda seed, epoch, device: None)
    meta = torch.device("meta")
    x, y = torch.rand(64, 3, 8, 8, device=meta), torch.randint(0, 10, (64,), device=meta)
    make_model = lambda: create_model(name, 16, 2, 10, (3, 8, 8), base_width=8)  # noqa: E731
    optimizer = lambda groups: schedulefree.AdamWScheduleFree(groups, warmup_steps=2)  # noqa: E731

    stack = StackedClassifier(build_members(make_model, [0, 1, 2], meta), optimizer, lr=1e-2)
    stack.train_sums = stack.train_sums.to(meta)  # as on_train_start does
    opt = stack.configure_optimizers()
    opt.train()
    groups = stacked_batches.StackedBatches(
        [stacked_batches.TrainSource(x, y)], [20, 40, 64], 16, augment=Augmentation(), pacing=stacked_batches.Pacing(2)
    )
    for _ in range(2):
        stack.train_group(groups.next(2), opt)
    drawn_before = groups.next(1)
    stack.remove([1])
    stack.train_group(drawn_before, opt)  # the rows of the members still in the stack
    groups.remove(1)
    stack.train_group(groups.next(1), opt)
    totals, count = stack.loss_sums(stack.eval_weights([0, 1]), [(x[:16], y[:16])])
    assert totals.device == meta and totals.shape == (2,) and count == 16
    assert all(p.device == meta for p in stack.parameters()) and stack.train_sums.device == meta


def test_moving_a_stacked_module_moves_its_loss_sums_with_the_stack() -> None:
    """``.to(device)`` outside a fit (benchmarks, a user's loop) must not leave the per-member loss sums behind:
    a step would then add CUDA losses into a CPU tensor. The meta device stands in for CUDA here."""
    from models.stacked_module import StackedClassifier
    from models.stacking import StackedModel

    module = StackedClassifier(
        StackedModel([create_model("mlp", 8, 1, 10, (1, 8, 8)) for _ in range(2)]), torch.optim.SGD, lr=0.1
    )
    module.to("meta")
    assert module.train_sums.device.type == "meta" and module.train_sums.dtype == torch.float64
    assert "train_sums" not in module.state_dict()


def test_members_with_their_own_training_sets_are_served_where_the_data_are(monkeypatch) -> None:
    """A pack's stack drawing from several runs' training sets (other erasers) puts every batch on the data's
    device (``meta`` stands in for a GPU: a CPU index or buffer mixed in fails there; it has no generator, so the
    epochs draw from the global one, as in test_both_engines_train_where_the_data_is)."""
    from datamodules import stacked_batches
    from datamodules.stacked_batches import Pacing, StackedBatches, TrainSource

    monkeypatch.setattr(stacked_batches, "epoch_generator", lambda seed, epoch, device: None)
    meta = torch.device("meta")
    x, y = torch.rand(64, 3, 8, 8, device=meta), torch.randint(0, 10, (64,), device=meta)
    other = TrainSource(
        torch.rand(64, 3, 8, 8, device=meta), torch.randint(0, 10, (64,), device=meta), lambda xb, yb: xb * 2
    )
    batches = StackedBatches(
        [TrainSource(x, y), other],
        [32, 64, 64],
        16,
        augment=Augmentation(),
        pacing=Pacing(2),
        seeds=[0, 0, 1],
        source_of=[0, 1, 1],
    )
    group = batches.next(2)
    assert all(t.device == meta for t in (group.x, group.y, group.weight)) and group.x.shape == (2, 3, 16, 3, 8, 8)


def test_highest_matmul_precision_is_true_fp32_in_cudnn_convolutions_too(tmp_path) -> None:
    """PyTorch lets cuDNN convolutions use TF32 whatever torch.set_float32_matmul_precision says; a run with
    trainer.matmul_precision=highest turns that off (on a GPU a stacked ConvNeXt and its members differed by 3.9e-3)."""
    import torch

    from models.precision import set_float32_precision

    before = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    try:
        set_float32_precision("high")
        assert torch.backends.cudnn.allow_tf32 and torch.get_float32_matmul_precision() == "high"
        run_experiment(compose_config([*FAST, "trainer.matmul_precision=highest"], tmp_path), tmp_path / "run")
        assert not torch.backends.cudnn.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.backends.cudnn.allow_tf32 = before[0]
        torch.set_float32_matmul_precision(before[1])
