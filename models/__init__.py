"""Model builders (a registry) and muP set-up; the LightningModule that trains them is models.stacked_module."""

from models.dependencies import check_dependencies

check_dependencies()  # before timm's builders: an old stack gets a message, not a TypeError in timm

from models.registry import available_models, create_model, register_model
from models.mup_setup import depth_scaled_lr, mup_param_groups, restore_base_shapes

# Each model's module is imported when its name is first asked for (models.registry._ON_DEMAND).

__all__ = [
    "available_models",
    "create_model",
    "depth_scaled_lr",
    "mup_param_groups",
    "register_model",
    "restore_base_shapes",
]
