"""The stacked engine: one ``Trainer.fit`` trains every model of a prequential run at once.

The S - 1 prefix models and the final model become members of one ``StackedModel``; each is
initialised exactly as the sequential engine initialises the model of its block (same seed,
same builder), draws its own batches from its own prefix (datamodules/stacked_batches.py) and
follows the protocol of ``PrequentialCallback`` (validation per own epoch, best weights, early
stopping, scoring in float64, leaving the stack). The whole stacked state is checkpointed at
the end of every pass over the full training set, so a killed run resumes bit for bit.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import lightning as L
import torch
from torch import nn

from datamodules.datamodule import ErasedDataModule
from datamodules.stacked_batches import StackedBatches
from mdl.callbacks import SaveLastCheckpoint
from mdl.codelength import check_paper_loss, heldout_block
from mdl.final_fit_curves import FinalFitCurves
from mdl.checkpoints import resumable, run_identity
from mdl.prequential import PROGRESS_FILE, finished_blocks, make_trainer, prequential_results, write_progress
from mdl.prequential_callback import MemberOutcome, PrequentialCallback
from mdl.progress_display import MemberProgress
from mdl.results import BlockResult
from mdl.trainer_settings import refuse_for_stacked
from models.losses import SpectralDecoupling
from models.module import OptimizerFactory
from models.stacked_module import StackedClassifier
from models.stacking import StackedModel

log = logging.getLogger(__name__)
CHECKPOINT = "checkpoints/stacked.ckpt"


def member_seeds(seed: int, num_boundaries: int) -> list[int]:
    """The sequential engine's seed for each block's model and, last, for the final model."""
    return [seed * 1000 + i for i in range(num_boundaries - 1)] + [seed * 1000 + num_boundaries]


def build_members(make_model: Callable[[], nn.Module], seeds: Sequence[int], device: torch.device) -> StackedModel:
    members = []
    for s in seeds:
        L.seed_everything(s, verbose=False)
        members.append(make_model().to(device))
    return StackedModel(members)


def run_prequential_stacked(
    dm: ErasedDataModule,
    boundaries: Sequence[int],
    make_model: Callable[[], nn.Module],
    optimizer: OptimizerFactory,
    lr: float,
    precision: str,
    trainer_kwargs: dict[str, Any],
    patience: int,
    seed: int,
    run_dir: str | Path,
    on_block: Callable[..., None] | None = None,  # (block index, result[, restored])
    checkpoint_every_s: float = 0.0,
    steps_per_group: int = 1,
    loss: SpectralDecoupling | None = None,
    final_curves: FinalFitCurves | None = None,
    callbacks: Sequence[L.Callback] = (),
    paper_loss: str = "last_block",
    on_epoch: Callable[[int, int, float, float], None] | None = None,
) -> dict[str, Any]:
    """Every block's model and the final one in one fit; returns the sequential engine's results schema.
    ``paper_loss`` as in ``run_prequential`` (with ``last_block`` the untrained model is a candidate).

    ``final_curves`` (e.g. the max-ent probes) is evaluated on the final member at each of its epoch
    ends and checkpointed with the stack; its curves are read from it afterwards.

    The stacked state is checkpointed at the end of a pass over the full training set, at most
    once every ``checkpoint_every_s`` seconds (0: every pass): a kill loses at most that much work.
    One Lightning step trains up to ``steps_per_group`` consecutive steps (datamodules/stacked_batches.py).
    """
    refuse_for_stacked(trainer_kwargs)
    check_paper_loss(paper_loss)
    run_dir = Path(run_dir)
    n_total, k, num_blocks = dm.num_train, dm.num_classes, len(boundaries) - 1
    if boundaries[-1] != n_total:
        raise ValueError(f"block schedule ends at {boundaries[-1]} but there are {n_total} training examples")
    progress_path = run_dir / PROGRESS_FILE
    finished_blocks(progress_path, boundaries)  # a stale attempt (other schedule or code) is discarded here
    if not progress_path.exists():  # from the start, so a later attempt by other code knows not to resume this one
        write_progress(progress_path, boundaries, [], engine="stacked", block_index=[])
    prefixes = list(boundaries[:-1]) + [n_total]
    loader = dm.stacked_train_loader(prefixes, steps_per_group)
    module = StackedClassifier(
        build_members(make_model, member_seeds(seed, len(boundaries)), dm.device), optimizer, lr, precision, loss=loss,
    )
    logged: set[int] = set()  # blocks given to on_block by this process

    def on_finish(outcome: MemberOutcome) -> None:
        """Record every member finished so far (restored ones included; members finish in any order)."""
        done = {m: _block(o, boundaries).to_dict() for m, o in sorted(protocol.outcomes.items()) if m < num_blocks}
        write_progress(progress_path, boundaries, list(done.values()), engine="stacked", block_index=list(done))
        if outcome.member < num_blocks:
            block = _block(outcome, boundaries)
            log.info(
                "block %d/%d: trained on %d, %d epochs (best after %d) | next %d examples: %.3f bits/example, "
                "val %.3f bits, last block %.3f bits", outcome.member + 1, num_blocks, block.n_train, block.epochs,
                block.best_after_epochs, block.n_eval, block.eval_bits / block.n_eval, block.val_bits_per_example,
                block.heldout_bits_per_example,
            )
            if on_block is not None:
                on_block(outcome.member, block)
                logged.add(outcome.member)
        else:
            log.info("final fit on %d examples: %d epochs, best val loss %.4f nats", n_total, outcome.epochs, outcome.best_val_loss)

    def score_batches(member: int):
        return dm.eval_loader(boundaries[member], boundaries[member + 1]) if member < num_blocks else dm.test_dataloader()

    def heldout_batches(member: int):
        """The last block for every prefix model but the one whose next block it already is."""
        held_start, held_stop = heldout_block(boundaries)
        return dm.eval_loader(held_start, held_stop) if boundaries[member] < held_start else None

    protocol = PrequentialCallback(
        loader, dm.val_dataloader, score_batches, patience, trainer_kwargs.get("max_epochs"), lr, on_finish=on_finish,
        on_member_epoch={num_blocks: final_curves} if final_curves is not None else None,
        heldout_batches=heldout_batches, untrained_candidate=paper_loss == "last_block", on_epoch=on_epoch,
    )
    checkpoint = run_dir / CHECKPOINT
    callbacks = [protocol, MemberProgress(protocol), *callbacks, SaveLastCheckpoint(checkpoint, checkpoint_every_s)]
    if final_curves is not None:  # in the Trainer only for its state in the checkpoints
        callbacks.insert(2, final_curves)
    kwargs = {**trainer_kwargs, "max_epochs": -1}  # the callback stops each member and then the fit
    identity = run_identity(run_dir)
    trainer = make_trainer(kwargs, dm.device, callbacks, checkpointing=True, identity=identity)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resumable(checkpoint, identity))
    # the checkpoint stays until the results are written (experiment.discard_resume_state): a disk that fills
    # while they are written must not cost the whole fit

    outcomes = protocol.outcomes
    blocks = [_block(outcomes[m], boundaries) for m in range(num_blocks)]
    restored = [m for m in range(num_blocks) if m not in logged]
    if restored and on_block is not None:  # finished before an interruption: this process's logger lacks them
        log.info("resumed: logging the %d block(s) finished before the interruption", len(restored))
        for m in restored:
            on_block(m, blocks[m], True)  # restored: with its curves
    final = outcomes[num_blocks]
    return prequential_results(
        boundaries, k, blocks, final.best_val_loss, final.epochs,
        final.scored_bits / final.scored_count if final.scored_count else None,
        final.val_loss_curve, final.train_loss_curve, paper_loss,
    )


def _block(outcome: MemberOutcome, boundaries: Sequence[int]) -> BlockResult:
    return BlockResult(
        n_train=outcome.n_train, n_eval=outcome.scored_count, eval_bits=outcome.scored_bits,
        val_bits_per_example=outcome.best_val_loss / math.log(2), epochs=outcome.epochs,
        val_loss_curve=outcome.val_loss_curve, train_loss_curve=outcome.train_loss_curve,
        heldout_bits_per_example=outcome.heldout_bits / outcome.heldout_count, best_after_epochs=outcome.best_epoch + 1,
    )
