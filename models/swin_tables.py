"""The constant tables of torchvision's Swin V2 attention (its relative coordinates table and position index, the
shifted windows' mask), made on a given device: torchvision keeps them as buffers, which the stacked form's
meta-device template does not have (models.swin_stacked). torchvision's code, verbatim where it allows.
"""

from __future__ import annotations

import torch
from torch import Tensor


def torchvision_relative_positions(
    window: list[int], device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """torchvision ``ShiftedWindowAttentionV2.define_relative_position_bias_table`` (float32, then the buffer's
    dtype) and ``ShiftedWindowAttention.define_relative_position_index``, made on ``device``."""
    relative_coords_h = torch.arange(-(window[0] - 1), window[0], dtype=torch.float32, device=device)
    relative_coords_w = torch.arange(-(window[1] - 1), window[1], dtype=torch.float32, device=device)
    table = torch.stack(torch.meshgrid([relative_coords_h, relative_coords_w], indexing="ij"))
    table = table.permute(1, 2, 0).contiguous().unsqueeze(0)  # 1, 2*Wh-1, 2*Ww-1, 2
    table[:, :, :, 0] /= window[0] - 1
    table[:, :, :, 1] /= window[1] - 1
    table *= 8  # normalize to -8, 8
    table = torch.sign(table) * torch.log2(torch.abs(table) + 1.0) / 3.0
    coords_h = torch.arange(window[0], device=device)
    coords_w = torch.arange(window[1], device=device)
    coords = torch.stack(torch.meshgrid(coords_h, coords_w, indexing="ij"))  # 2, Wh, Ww
    coords_flatten = torch.flatten(coords, 1)  # 2, Wh*Ww
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]  # 2, Wh*Ww, Wh*Ww
    relative_coords = relative_coords.permute(1, 2, 0).contiguous()  # Wh*Ww, Wh*Ww, 2
    relative_coords[:, :, 0] += window[0] - 1  # shift to start from 0
    relative_coords[:, :, 1] += window[1] - 1
    relative_coords[:, :, 0] *= 2 * window[1] - 1
    return table.to(dtype), relative_coords.sum(-1).flatten()


def torchvision_shift_mask(
    pad_height: int, pad_width: int, window: list[int], shift: list[int], like: Tensor
) -> Tensor:
    """torchvision ``shifted_window_attention``'s attention mask (windows, N, N): 0 within a region, -100 across."""
    attn_mask = like.new_zeros((pad_height, pad_width))
    h_slices = ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None))
    w_slices = ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None))
    count = 0
    for h in h_slices:
        for w in w_slices:
            attn_mask[h[0] : h[1], w[0] : w[1]] = count
            count += 1
    num_windows = (pad_height // window[0]) * (pad_width // window[1])
    attn_mask = attn_mask.view(pad_height // window[0], window[0], pad_width // window[1], window[1])
    attn_mask = attn_mask.permute(0, 2, 1, 3).reshape(num_windows, window[0] * window[1])
    attn_mask = attn_mask.unsqueeze(1) - attn_mask.unsqueeze(2)
    return attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))


# --- checks ---------------------------------------------------------------------------------------------------------
