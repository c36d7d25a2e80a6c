"""Trainer settings (``trainer.kwargs``) that act on Lightning's steps, validation loop or stopping,
and what each engine does with them. One table, so the two engines cannot drift apart.

The sequential engine trains one model per ``Trainer.fit``: settings that act on training steps
make it take one optimizer step per Lightning step (Lightning's automatic optimization) instead of
a group of them; settings of the validation loop or step limits are refused. The stacked engine
trains every member in one fit under ``StackedProtocol``'s own protocol, so it refuses all of
them, and ``min_epochs`` too (members stop on their own).
"""

from __future__ import annotations

from typing import Any

# Each setting with its neutral value: the one that leaves Lightning's default behaviour alone.
# A float neutral value is a fraction of an epoch: an int there counts batches (1 = one batch).
# None is neutral only where it is Lightning's own default (NONE_IS_DEFAULT).
STEP_SETTINGS: dict[str, int | float] = {
    "gradient_clip_val": 0,
    "accumulate_grad_batches": 1,
    "fast_dev_run": 0,
    "overfit_batches": 0,
    "limit_train_batches": 1.0,
}
VALIDATION_SETTINGS: dict[str, int | float] = {
    "check_val_every_n_epoch": 1,
    "limit_val_batches": 1.0,
    "val_check_interval": 1.0,
}
STEP_LIMITS: dict[str, int | float | None] = {"max_steps": -1, "min_steps": 0, "max_time": None}
NONE_IS_DEFAULT = frozenset(
    {
        "gradient_clip_val",
        "limit_train_batches",
        "limit_val_batches",
        "val_check_interval",
        "min_steps",
        "min_epochs",
        "max_time",
    }
)

VALIDATES = (
    "the prequential protocol validates every model at the end of each of its epochs on the whole validation "
    "split (mdl.engine.protocol); remove it"
)
STOPS = (
    "a prequential fit ends by early stopping or trainer.kwargs.max_epochs, and Lightning does not resume a "
    "step- or time-limited fit from an epoch-end checkpoint; use max_epochs (and, with mdl.members_per_fit=1, min_epochs)"
)
STACKED = (
    "the members of a stacked fit follow the prequential protocol (one step per member per global step, "
    "validation every member epoch, early stopping); remove it, or use mdl.members_per_fit=1 (one member per fit)"
)
CLIPS = (
    "Lightning would clip the norm of the whole stack, not of each member; use mdl.members_per_fit=1 "
    "(one member per fit) for gradient clipping"
)


def active(trainer_kwargs: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """The settings among ``settings`` given in ``trainer_kwargs`` with a value that changes Lightning's behaviour."""
    return [
        key
        for key, neutral in settings.items()
        if key in trainer_kwargs and not _inert(key, trainer_kwargs[key], neutral)
    ]


def settings_needing_single_steps(trainer_kwargs: dict[str, Any]) -> list[str]:
    """The settings that make the sequential engine take one optimizer step per Lightning step."""
    return active(trainer_kwargs, STEP_SETTINGS)


def refuse_for_sequential(trainer_kwargs: dict[str, Any]) -> None:
    """The sequential engine validates in place (so a validation-loop setting would be silently
    ignored) and resumes from epoch-end checkpoints (which a step limit does not survive)."""
    for settings, why in ((VALIDATION_SETTINGS, VALIDATES), (STEP_LIMITS, STOPS)):
        _refuse(trainer_kwargs, active(trainer_kwargs, settings), why)


def refuse_for_stacked(trainer_kwargs: dict[str, Any]) -> None:
    """Everything the sequential engine refuses, plus what it handles by single steps (Lightning's
    manual optimization would reject two of them with a less helpful message) and ``min_epochs``."""
    _refuse(trainer_kwargs, active(trainer_kwargs, {"gradient_clip_val": 0}), CLIPS)
    refuse_for_sequential(trainer_kwargs)
    _refuse(trainer_kwargs, active(trainer_kwargs, {**STEP_SETTINGS, "min_epochs": 0}), STACKED)


def _refuse(trainer_kwargs: dict[str, Any], keys: list[str], why: str) -> None:
    if keys:
        raise ValueError(f"trainer.kwargs.{keys[0]}={trainer_kwargs[keys[0]]}: {why}")


def _inert(key: str, value: Any, neutral: Any) -> bool:
    """Whether a setting's value leaves Lightning's default behaviour alone."""
    if value is None:
        return key in NONE_IS_DEFAULT
    if neutral is None:
        return False
    if isinstance(neutral, float):  # a fraction of the epoch; an int counts batches
        return isinstance(value, float) and value == neutral
    return value == neutral
