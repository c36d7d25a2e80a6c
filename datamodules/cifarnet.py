"""CIFARNet (``EleutherAI/cifarnet``: 64x64 RGB ImageNet-21K images in the 10 CIFAR classes).

Read with the ``datasets`` library from a copy saved by ``DatasetDict.save_to_disk`` (columns
``img``: Image, ``label``: ClassLabel; splits ``train`` and ``test``). With ``download=true`` the
copy is made from the Hugging Face hub (or from the user's Hugging Face cache, which
``load_dataset`` reuses; set ``HF_HUB_OFFLINE=1`` to forbid the network) and saved under the
data root, so later runs read it without the hub.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datamodules.data_root import bad_data, data_root, downloading, missing_data, reading
from datamodules.sources import ImageSet, ImageSource, check_labels, register_source, uint8_images

IMAGE_COLUMN = "img"
LABEL_COLUMN = "label"


def _save_from_hub(hub_id: str, folder: Path) -> None:
    """Fetch the data set through ``load_dataset`` and save it to ``folder`` atomically."""
    from datasets import load_dataset

    data = load_dataset(hub_id)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        data.save_to_disk(str(tmp))
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _to_image_set(split: Any, side: int, decode_batch_size: int) -> ImageSet:
    """Decode every image to RGB uint8 (grey or RGBA sources are converted), check the size."""
    images: list[np.ndarray] = []
    labels: list[int] = []
    for batch in split.iter(batch_size=decode_batch_size):
        for image in batch[IMAGE_COLUMN]:
            array = np.asarray(image.convert("RGB"))
            if array.shape != (side, side, 3):
                raise ValueError(
                    f"cifarnet: expected {side}x{side} images, found one of size {array.shape[1]}x{array.shape[0]}; "
                    f"set data.options.side={array.shape[0]} if this copy was resized on purpose"
                )
            images.append(array)
        labels.extend(int(v) for v in batch[LABEL_COLUMN])
    x = uint8_images(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    return ImageSet(x, torch.as_tensor(labels, dtype=torch.int64))


@register_source("cifarnet", size=lambda side=64, **_: (200_000, (3, side, side)))
def load_cifarnet(
    root: str | os.PathLike | None = None,
    download: bool = False,
    path: str | os.PathLike | None = None,
    hub_id: str = "EleutherAI/cifarnet",
    side: int = 64,
    decode_batch_size: int = 1024,
    **_: Any,
) -> ImageSource:
    """Train / test splits of a saved CIFARNet copy; ``path`` defaults to ``<root>/cifarnet``."""
    from datasets import DatasetDict

    folder = Path(os.path.expanduser(str(path))).absolute() if path else data_root(root, "cifarnet") / "cifarnet"
    resave = f"save it again with `datasets.load_dataset('{hub_id}').save_to_disk('{folder}')`"
    with reading("cifarnet", folder, resave):
        exists = folder.exists()
    if not exists and download:
        by_hand = (
            f"on a machine with network access run `datasets.load_dataset('{hub_id}').save_to_disk('{folder}')` "
            f"and copy the folder here"
        )
        with downloading("cifarnet", f"{hub_id} from the Hugging Face hub", by_hand):
            _save_from_hub(hub_id, folder)
        exists = True
    if not exists:
        raise missing_data(
            "cifarnet",
            folder,
            "a data set saved by datasets' save_to_disk (dataset_dict.json, train/, test/)",
            f"run once with data.options.download=true on a machine with network access (loads {hub_id} "
            f"from the Hugging Face hub and saves it there), or on any machine run "
            f"`datasets.load_dataset('{hub_id}').save_to_disk('{folder}')` and copy the folder here",
        )
    data = _load_saved(folder, resave)
    if not isinstance(data, DatasetDict) or not {"train", "test"} <= set(data):
        raise ValueError(
            f"cifarnet: {folder} must hold a DatasetDict with splits 'train' and 'test', found "
            f"{type(data).__name__} {list(data) if isinstance(data, DatasetDict) else ''}; "
            f"save the whole `load_dataset('{hub_id}')` result"
        )
    columns = set(data["train"].column_names)
    if not {IMAGE_COLUMN, LABEL_COLUMN} <= columns:
        raise ValueError(
            f"cifarnet: {folder} has columns {sorted(columns)}, expected {IMAGE_COLUMN!r} and {LABEL_COLUMN!r}"
        )
    feature = data["train"].features[LABEL_COLUMN]
    sets = {}
    for split in ("train", "test"):
        with reading("cifarnet", folder / split, resave):
            sets[split] = _to_image_set(data[split], side, decode_batch_size)
    if hasattr(feature, "names"):
        classes = list(feature.names)
    else:
        classes = [str(c) for c in range(int(max(sets["train"].y.max(), sets["test"].y.max())) + 1)]
    for split, images in sets.items():
        check_labels(images.y, len(classes), f"cifarnet: {folder / split} (column {LABEL_COLUMN!r})", resave)
    return ImageSource(name="cifarnet", train=sets["train"], test=sets["test"], classes=classes)


def _load_saved(folder: Path, resave: str) -> Any:
    """``load_from_disk`` with its failures reported against the folder."""
    from datasets import load_from_disk

    with reading("cifarnet", folder, resave):
        try:
            return load_from_disk(str(folder))
        except FileNotFoundError as err:  # datasets' word for "not a save_to_disk folder"
            raise bad_data("cifarnet", folder, f"is not a data set written by save_to_disk ({err})", resave) from err
        except OSError:
            raise
        except Exception as err:  # damaged arrow files or json raise many types
            raise bad_data("cifarnet", folder, f"could not be loaded ({type(err).__name__}: {err})", resave) from err
