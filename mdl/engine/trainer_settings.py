"""Trainer settings (``trainer.kwargs``) that act on Lightning's steps, validation loop or stopping: refused.

Every fit trains a stack of members under ``StackedProtocol``'s own protocol (manual optimization, validation at
each member's epoch end, early stopping per member), so a setting of Lightning's steps, validation loop, step
limits or ``min_epochs`` would be ignored or act on the whole stack: each is refused with what to do instead.
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
    "step- or time-limited fit from an epoch-end checkpoint; use max_epochs"
)
STACKED = (
    "the members of a fit follow the prequential protocol (one step per member per global step, validation every "
    "member epoch, early stopping); remove it"
)
CLIPS = (
    "a fit trains its members as one stack (manual optimization), where Lightning cannot clip each member's "
    "gradient norm; remove it"
)


def active(trainer_kwargs: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """The settings among ``settings`` given in ``trainer_kwargs`` with a value that changes Lightning's behaviour."""
    return [
        key
        for key, neutral in settings.items()
        if key in trainer_kwargs and not _inert(key, trainer_kwargs[key], neutral)
    ]


def refuse_for_stacked(trainer_kwargs: dict[str, Any]) -> None:
    """The protocol validates in place (a validation-loop setting would be silently ignored), resumes from
    epoch-end checkpoints (which a step limit does not survive) and steps each member itself."""
    for settings, why in (
        ({"gradient_clip_val": 0}, CLIPS),
        (VALIDATION_SETTINGS, VALIDATES),
        (STEP_LIMITS, STOPS),
        ({**STEP_SETTINGS, "min_epochs": 0}, STACKED),
    ):
        _refuse(trainer_kwargs, active(trainer_kwargs, settings), why)


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
