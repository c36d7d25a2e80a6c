"""Speed settings of a run: one mixed-precision switch, channels-last memory, reusable torch.compile.

They are settings of the training run (``trainer.precision``, ``trainer.channels_last``,
``trainer.compile``; conf/trainer/), not of a model's shapes; the stacked model (``models.stacking``) applies them:

- ``precision``: ``fp32`` (default; exact, and on CUDA TF32 in matmuls and convolutions only if
  ``trainer.matmul_precision`` allows it: set_float32_precision) or ``bf16`` (every forward pass under bf16 autocast: training, validation and the
  scoring of each prequential block). Logits are returned in float32 and code lengths are summed
  in float64 whatever the compute dtype, so bf16 changes the numbers only through the rounding of
  the forward pass (about 3 significant digits per activation). It is the one switch: Lightning's
  own ``precision`` argument stays at 32-true.
- ``channels_last``: a stack of one's weights and image batches in channels-last memory (faster convolutions on
  GPUs with bf16; same math).
- ``compile``: torch.compile of the stacked computation, once per fit (``StackedModel.compile``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ContextManager

import torch

PRECISIONS = ("fp32", "bf16")
COMMON_BACKENDS = ("inductor", "eager", "aot_eager", "cudagraphs")  # built into torch (torch._dynamo.list_backends)


def set_float32_precision(matmul_precision: str) -> None:
    """``trainer.matmul_precision`` for every fp32 kernel: matmuls (torch.set_float32_matmul_precision) and cuDNN's
    convolutions, which PyTorch lets use TF32 by default whatever the matmul setting. ``highest`` is true fp32 for
    both, so a convolution net's fp32 numbers do not depend on the GPU generation; ``high``/``medium`` allow TF32."""
    torch.set_float32_matmul_precision(matmul_precision)
    torch.backends.cudnn.allow_tf32 = matmul_precision != "highest"


def check_precision(precision: Any) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def autocast_context(precision: str, device_type: str) -> ContextManager[Any]:
    """bf16 autocast on the input's device type, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check_compile(compile: Any) -> str | None:
    """The torch.compile backend asked for (None = off)."""
    if compile in (False, None):
        return None
    if compile is True:
        return "inductor"
    if isinstance(compile, str):
        if compile in COMMON_BACKENDS:
            return compile
        import torch._dynamo  # 1.5 s to import: only for a backend name we do not know

        backends = torch._dynamo.list_backends(exclude_tags=())
        if compile in backends:
            return compile
        raise ValueError(
            f"trainer.compile={compile!r}: not a torch.compile backend here; use true (inductor), "
            f"false, or one of {[b for b in backends if 'TESTING' not in b]}"
        )
    raise ValueError(f"trainer.compile must be false, true or a torch.compile backend name, got {compile!r}")


def share_compile_cache(folder: str | None) -> None:
    """Inductor's caches (its graphs, autograd's and Triton's kernels) in ``folder`` (``paths.compile_cache_dir``,
    under the cache folder a Slurm array shares), so a sweep's later jobs of one shape load what the first compiled:
    a stacked ConvNeXt's first step on 2 CPU cores took 64.6 s cold and 3.7 s with an earlier job's cache. A cache
    folder the environment names (TORCHINDUCTOR_CACHE_DIR) wins; null leaves torch's default (under /tmp)."""
    if folder and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
