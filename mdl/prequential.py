"""The prequential driver: a fresh model per data prefix, scored on the next block.

For boundaries t_1 < ... < t_S = N it fits a new model on train[:t_i] (early stopping on the
validation split, best weights restored), records the bits it needs for train[t_i:t_{i+1}] and
its mean validation loss, and finally fits once on all N examples. Finished blocks are recorded
in ``progress.json`` after each fit, so a re-launched job continues where it stopped.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import lightning as L
import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment

from datamodules.datamodule import ErasedDataModule
from mdl.callbacks import EpochProtocol, SaveLastCheckpoint
from mdl.checkpoints import RunCheckpointIO, resumable, run_identity
from mdl.device import lightning_device_kwargs
from mdl.codelength import check_paper_loss, heldout_block, online_codelength, paper_mdl, uniform_codelength
from mdl.progress_display import EpochHook, FitProgress
from mdl.results import PROGRESS_FILE, BlockResult, DamagedRecord, code_version, read_checked_json, write_checked_json
from mdl.trainer_settings import refuse_for_sequential, settings_needing_single_steps
from models.module import Classifier, total_bits

log = logging.getLogger(__name__)


@dataclass
class FitOutcome:
    module: Classifier
    epochs: int
    best_val_loss: float  # nats
    best_epoch: int  # 0-based index of the kept epoch; -1 = the untrained model
    seconds: float


def fit_prefix(
    dm: ErasedDataModule,
    n_train: int | None,
    make_module: Callable[[], Classifier],
    trainer_kwargs: dict[str, Any],
    patience: int,
    checkpoint: Path | None = None,
    checkpoint_every_s: float = 0.0,
    extra_callbacks: Sequence[L.Callback] = (),
    steps_per_group: int = 1,
    untrained_candidate: bool = False,
    identity: str = "",
) -> FitOutcome:
    """Train a fresh model on the first n_train examples (None = all) with early stopping.

    The model trains on the data module's device and is returned there, holding its best
    epoch's weights. With ``checkpoint`` set, the fit saves its state there every epoch and, if
    an intact file already exists (an interrupted earlier attempt), continues from it; a damaged
    one is discarded with a warning and the fit starts over. ``checkpoint_every_s`` > 0 skips the
    saves of epochs that end less than that long after the last one (the first epoch and the
    stopping one are always saved). ``extra_callbacks`` join the fit (and its checkpoints), e.g. the
    final fit's max-ent probe curves. One Lightning step trains ``steps_per_group`` consecutive
    batches (manual optimization) unless a trainer setting needs one step per Lightning step.
    ``untrained_candidate``: the untrained model is validated too and kept if no epoch beats it.
    ``identity`` (mdl/checkpoints.py ``run_identity``) stamps the checkpoint; only a checkpoint with the
    same stamp is resumed.
    """
    start = time.perf_counter()
    refuse_for_sequential(trainer_kwargs)
    device = dm.device
    steps = 1 if settings_needing_single_steps(trainer_kwargs) else steps_per_group
    dm.use_prefix(n_train, steps)
    module = make_module()
    module.automatic_optimization = steps == 1
    best = EpochProtocol(dm.val_dataloader, patience, device, untrained_candidate)
    callbacks: list[L.Callback] = [best, *extra_callbacks]
    if checkpoint is not None:
        callbacks.append(SaveLastCheckpoint(checkpoint, checkpoint_every_s))
    resume_from = resumable(checkpoint, identity)
    trainer = make_trainer(trainer_kwargs, device, callbacks, checkpointing=checkpoint is not None, identity=identity)
    with warnings.catch_warnings():  # no val_dataloader on purpose: EpochProtocol validates
        warnings.filterwarnings("ignore", message=".*defined a `validation_step` but have no `val_dataloader`")
        trainer.fit(module, train_dataloaders=dm.train_dataloader(), ckpt_path=resume_from)
    best.restore(module)  # back on the training device: Lightning's teardown moved it to the CPU
    # best_val_loss: the float64 value of the compared float32 one
    return FitOutcome(module, trainer.current_epoch, best.best_val_loss, best.best_epoch, time.perf_counter() - start)


def make_trainer(
    trainer_kwargs: dict[str, Any], device: torch.device, callbacks: list[L.Callback], checkpointing: bool,
    identity: str = "",
) -> L.Trainer:
    """A quiet Trainer on the run's device, saving checkpoints (stamped with ``identity``) only through our callbacks."""
    plugins: list[Any] = [RunCheckpointIO(device, identity)]
    if SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=False))  # submitit owns requeueing
    return L.Trainer(
        **{**trainer_kwargs, **lightning_device_kwargs(device)},
        callbacks=callbacks,
        plugins=plugins,
        logger=False,
        enable_checkpointing=checkpointing,  # our SaveLastCheckpoint, never a default one
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def finished_blocks(progress_path: Path, boundaries: Sequence[int]) -> list[dict[str, Any]]:
    """Blocks an earlier attempt of this run finished, if they can be trusted; else none.

    A damaged progress file, another block schedule or another code version means starting over
    (with a warning): a result is always computed by one version of the code. Checkpoints of the
    discarded attempt are removed with it.
    """
    if not progress_path.exists():
        return []
    try:
        saved = read_checked_json(progress_path)
    except DamagedRecord as err:
        reason = str(err)
    else:
        if saved.get("boundaries") != list(boundaries):
            reason = f"its block schedule {saved.get('boundaries')} differs from {list(boundaries)}"
        elif saved.get("code_version") != code_version():
            reason = f"it was made by code version {saved.get('code_version')}, this is {code_version()}"
        else:
            log.info("resuming: %d of %d blocks already done", len(saved["blocks"]), len(boundaries) - 1)
            return saved["blocks"]
    log.warning("discarding the earlier progress of this run (%s); starting it over", reason)
    progress_path.unlink(missing_ok=True)
    for stale in progress_path.parent.glob("checkpoints/*.ckpt"):
        stale.unlink(missing_ok=True)
    return []


def write_progress(path: Path, boundaries: Sequence[int], blocks: list[dict[str, Any]], **extra: Any) -> None:
    """progress.json: the finished blocks of a run, with the schedule and code version they belong to."""
    write_checked_json(path, {"boundaries": list(boundaries), "code_version": code_version(), **extra, "blocks": blocks})


def run_prequential(
    dm: ErasedDataModule,
    boundaries: Sequence[int],
    make_module: Callable[[], Classifier],
    trainer_kwargs: dict[str, Any],
    patience: int,
    seed: int,
    run_dir: str | Path,
    on_block: Callable[..., None] | None = None,  # (block index, result[, restored])
    checkpoint_every_s: float = 0.0,
    final_curves: L.Callback | None = None,
    callbacks: Sequence[L.Callback] = (),
    steps_per_group: int = 1,
    paper_loss: str = "last_block",
    on_epoch: EpochHook | None = None,
) -> dict[str, Any]:
    """Run every block (resuming finished ones from ``run_dir/progress.json``) and the final fit;
    ``final_curves`` (e.g. the max-ent probes, mdl/final_fit_curves.py) is a callback of the final fit only;
    ``callbacks`` join every fit (e.g. models/preconditioning.py). Each Lightning step trains up to
    ``steps_per_group`` batches (``fit_prefix``). ``paper_loss`` (mdl/codelength.py PAPER_LOSSES) picks
    the paper MDL's L(c_i); with ``last_block`` every fit also has the untrained model as a candidate."""
    untrained_candidate = check_paper_loss(paper_loss) == "last_block"
    single_steps = settings_needing_single_steps(trainer_kwargs)
    if single_steps and steps_per_group > 1:
        log.info("trainer.kwargs.%s set: one optimizer step per Lightning step (mdl.steps_per_group=%d not used)",
                 single_steps[0], steps_per_group)
    run_dir = Path(run_dir)
    progress_path = run_dir / PROGRESS_FILE
    n_total, k = dm.num_train, dm.num_classes
    if boundaries[-1] != n_total:
        raise ValueError(f"block schedule ends at {boundaries[-1]} but there are {n_total} training examples")
    done = finished_blocks(progress_path, boundaries)
    if not progress_path.exists():  # from the start, so a later attempt by other code knows not to resume this one
        write_progress(progress_path, boundaries, [])
    blocks = [BlockResult(**b) for b in done]
    if blocks and on_block is not None:  # a resumed run's logger is new: give it the series of the blocks done before
        log.info("resuming: logging the %d block(s) finished before the interruption again", len(blocks))
        for i, block in enumerate(blocks):
            on_block(i, block, True)  # restored: with its curves
    identity = run_identity(run_dir)

    for i in range(len(blocks), len(boundaries) - 1):
        n_train, n_next = boundaries[i], boundaries[i + 1]
        L.seed_everything(seed * 1000 + i, verbose=False)
        ckpt = run_dir / "checkpoints" / f"block{i:02d}.ckpt"
        progress = FitProgress(i, f"block {i + 1}/{len(boundaries) - 1}", patience, trainer_kwargs.get("max_epochs"), on_epoch)
        fit = fit_prefix(dm, n_train, make_module, trainer_kwargs, patience, ckpt, checkpoint_every_s,
                         [*callbacks, progress], steps_per_group, untrained_candidate, identity)
        eval_bits, n_eval = total_bits(fit.module, dm.eval_loader(n_train, n_next))
        held_start, held_stop = heldout_block(boundaries)
        held_bits, n_held = (eval_bits, n_eval) if n_train == held_start else total_bits(fit.module, dm.eval_loader(held_start, held_stop))
        block = BlockResult(
            n_train=n_train, n_eval=n_eval, eval_bits=eval_bits,
            val_bits_per_example=fit.best_val_loss / math.log(2), epochs=fit.epochs,
            val_loss_curve=fit.module.val_loss_curve, train_loss_curve=fit.module.train_loss_curve,
            heldout_bits_per_example=held_bits / n_held, best_after_epochs=fit.best_epoch + 1,
        )
        blocks.append(block)
        write_progress(progress_path, boundaries, [b.to_dict() for b in blocks])
        ckpt.unlink(missing_ok=True)
        log.info(
            "block %d/%d: trained on %d, %d epochs (best after %d), %.1fs | next %d examples: %.3f bits/example, "
            "val %.3f bits, last block %.3f bits", i + 1, len(boundaries) - 1, n_train, fit.epochs,
            block.best_after_epochs, fit.seconds, n_eval, eval_bits / n_eval, block.val_bits_per_example,
            block.heldout_bits_per_example,
        )
        if on_block is not None:
            on_block(i, block)

    L.seed_everything(seed * 1000 + len(boundaries), verbose=False)
    final = fit_prefix(
        dm, None, make_module, trainer_kwargs, patience, run_dir / "checkpoints" / "final.ckpt", checkpoint_every_s,
        extra_callbacks=[*callbacks, *([final_curves] if final_curves is not None else []),
                         FitProgress(len(boundaries) - 1, "final fit", patience, trainer_kwargs.get("max_epochs"), on_epoch)],
        steps_per_group=steps_per_group,
        untrained_candidate=untrained_candidate, identity=identity,
    )
    test_bits, n_test = total_bits(final.module, dm.test_dataloader())
    log.info("final fit on %d examples: %d epochs, best val loss %.4f nats", n_total, final.epochs, final.best_val_loss)

    return prequential_results(
        boundaries, k, blocks, final.best_val_loss, final.epochs, test_bits / n_test if n_test else None,
        final.module.val_loss_curve, final.module.train_loss_curve, paper_loss,
    )


def prequential_results(
    boundaries: Sequence[int],
    k: int,
    blocks: list[BlockResult],
    final_val_loss: float,
    final_epochs: int,
    final_test_bits_per_example: float | None,
    val_loss_curve: list[float],
    train_loss_curve: list[float],
    paper_loss: str,
) -> dict[str, Any]:
    """The results.json fields of a prequential run (both engines write the same schema). Both
    estimates of the paper MDL are recorded; ``paper_mdl`` is the one ``paper_loss`` names."""
    n_total = boundaries[-1]
    online = online_codelength(boundaries, k, [b.eval_bits for b in blocks])
    estimates = {
        "last_block": paper_mdl(boundaries, [b.heldout_bits_per_example for b in blocks]),
        "val_min": paper_mdl(boundaries, [b.val_bits_per_example for b in blocks]),
    }
    return {
        "num_classes": k,
        "n_train": n_total,
        "boundaries": list(boundaries),
        "blocks": [b.to_dict() for b in blocks],
        "online_codelength_bits": online,
        "online_bits_per_example": online / n_total,
        "uniform_codelength_bits": uniform_codelength(n_total, k),
        "paper_mdl": estimates[check_paper_loss(paper_loss)],
        "paper_loss": paper_loss,
        "paper_mdl_last_block": estimates["last_block"],
        "paper_mdl_val_min": estimates["val_min"],
        "final_val_loss": final_val_loss,
        "final_epochs": final_epochs,
        "final_test_bits_per_example": final_test_bits_per_example,  # None without a test split
        "val_loss_curve": val_loss_curve,
        "train_loss_curve": train_loss_curve,
    }
