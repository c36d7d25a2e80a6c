"""Data sources and the LightningDataModule that serves erased, augmented batches."""

from datamodules.sources import ImageSet, ImageSource, available_sources, load_source, register_source

# The shipped sources' modules are imported when their name is first used (datamodules.sources.SHIPPED).

__all__ = ["ImageSet", "ImageSource", "available_sources", "load_source", "register_source"]
