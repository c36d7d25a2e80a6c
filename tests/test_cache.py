"""The erasure cache: hits fit nothing, a changed option refits, damage is detected and rebuilt,
two processes filling one key leave one valid file built once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from datamodules.cache import CorruptCacheFile, ErasureCache, cache_key, read_checked
from erasure import fit_eraser

REPO = Path(__file__).resolve().parents[1]


def class_data(n: int = 200, d: int = 6, k: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % k
    x = torch.randn(n, d, generator=g, dtype=torch.float64) + y[:, None].double()
    return x, y


class CountingFit:
    """Fits the real eraser and counts how often it was asked to."""

    def __init__(self, name: str, x: torch.Tensor, y: torch.Tensor, **options) -> None:
        self.name, self.x, self.y, self.options, self.calls = name, x, y, options, 0

    def __call__(self):
        self.calls += 1
        return fit_eraser(self.name, self.x, self.y, **self.options)


def test_key_is_stable_and_sensitive() -> None:
    a = cache_key(
        source={"name": "cifar10", "root": "/d"}, split={"data_seed": 0, "val_size": 2048}, eraser={"name": "leace"}
    )
    b = cache_key(
        eraser={"name": "leace"}, split={"val_size": 2048, "data_seed": 0}, source={"root": "/d", "name": "cifar10"}
    )
    assert a == b
    assert a != cache_key(
        source={"name": "cifar10", "root": "/d"}, split={"data_seed": 1, "val_size": 2048}, eraser={"name": "leace"}
    )


def test_second_run_fits_nothing_and_changed_option_refits(tmp_path: Path) -> None:
    x, y = class_data()
    fit = CountingFit("leace", x, y)
    key = cache_key(eraser={"name": "leace", "options": {}})
    first = ErasureCache(tmp_path).eraser(key, fit)
    second_cache = ErasureCache(tmp_path)  # a new job of the same sweep
    second = second_cache.eraser(key, fit)
    assert fit.calls == 1 and second_cache.stats.hits == 1 and second_cache.stats.builds == 0
    assert torch.equal(first(x), second(x))  # bit-identical reuse

    changed = CountingFit("leace", x, y, batch_size=7)
    other_key = cache_key(eraser={"name": "leace", "options": {"batch_size": 7}})
    assert other_key != key
    ErasureCache(tmp_path).eraser(other_key, changed)
    assert changed.calls == 1


def test_erased_tensors_round_trip(tmp_path: Path) -> None:
    calls = []
    tensors = {"train_x": torch.rand(5, 1, 4, 4), "train_y": torch.arange(5)}

    def build():
        calls.append(1)
        return tensors, {"classes": ["a", "b"]}

    key = cache_key(what="data")
    ErasureCache(tmp_path).tensors(key, build)
    got, info = ErasureCache(tmp_path).tensors(key, build)
    assert len(calls) == 1 and info == {"classes": ["a", "b"]}
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)
    assert [p.name for p in tmp_path.iterdir() if p.suffix != ".lock"] == [f"{key}.data.safetensors"]


@pytest.mark.parametrize("damage", ["truncate", "flip_a_byte"])
def test_damaged_file_is_detected_and_rebuilt(tmp_path: Path, damage: str) -> None:
    x, y = class_data()
    fit = CountingFit("leace", x, y)
    key = cache_key(eraser={"name": "leace"})
    cache = ErasureCache(tmp_path)
    reference = cache.eraser(key, fit)
    path = cache.eraser_path(key)
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    else:  # a flipped bit in the tensor data: safetensors loads it, the checksum must not
        path.write_bytes(raw[:-10] + bytes([raw[-10] ^ 0xFF]) + raw[-9:])
    with pytest.raises(CorruptCacheFile):
        read_checked(path)
    again = ErasureCache(tmp_path)
    with pytest.warns(RuntimeWarning, match="rebuilding"):
        rebuilt = again.eraser(key, fit)
    assert fit.calls == 2 and again.stats.rebuilt_corrupt == 1
    read_checked(path)  # valid again
    assert torch.equal(rebuilt(x), reference(x))


def test_a_flipped_bit_in_any_header_byte_is_caught_or_harmless(tmp_path: Path) -> None:
    """A flipped bit in the JSON header (metadata, names, shapes) must not load as a different eraser:
    safetensors may parse it, so the checksum covers the metadata too (a chaos sweep once renamed a field)."""
    x, y = class_data()
    key = cache_key(eraser={"name": "leace"})
    cache = ErasureCache(tmp_path)
    reference = cache.eraser(key, CountingFit("leace", x, y))
    path = cache.eraser_path(key)
    raw = path.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    loaded = 0
    for at in range(8, header_end):  # every byte, one bit each (all eight bits of every byte also pass, in 8x the time)
        damaged = bytearray(raw)
        damaged[at] ^= 1 << (at % 8)
        path.write_bytes(bytes(damaged))
        try:
            read_checked(path)
        except CorruptCacheFile:
            continue
        loaded += 1  # parsed and matched: it must be the same eraser
        assert torch.equal(ErasureCache(tmp_path).eraser(key, CountingFit("leace", x, y))(x), reference(x))
    assert loaded < (header_end - 8) / 8  # nearly every flip is caught


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from datamodules.cache import ErasureCache, cache_key

    folder, counter, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])

    def build():
        with open(counter, "a") as f:
            f.write("built\\n")
        time.sleep(1.0)  # a slow fit: the other process arrives while this one writes
        g = torch.Generator().manual_seed(0)
        return {"x": torch.randn(300, 3, 8, 8, generator=g), "y": torch.arange(300)}, {}

    while not go.exists():
        time.sleep(0.01)
    out, _ = ErasureCache(folder).tensors(cache_key(what="shared"), build)
    assert out["x"].shape == (300, 3, 8, 8)
    print("ok")
    """
)


@pytest.mark.slow
def test_two_processes_filling_one_key(tmp_path: Path) -> None:
    folder, counter, go = tmp_path / "cache", tmp_path / "built.txt", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(folder), str(counter), str(go)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    time.sleep(0.5)
    go.touch()  # both start filling at once (they poll for this file)
    results = [c.communicate(timeout=120) for c in children]
    for child, (out, err) in zip(children, results):
        assert child.returncode == 0, err
        assert out.strip() == "ok"
    assert counter.read_text().count("built") == 1  # no duplicated work
    files = sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))
    assert files == [f"{cache_key(what='shared')}.data.safetensors"]  # one file, no temporaries left
    tensors, _ = read_checked(folder / files[0])
    assert torch.equal(tensors["y"], torch.arange(300))


def test_no_directory_means_no_cache(tmp_path: Path) -> None:
    x, y = class_data()
    fit = CountingFit("none", x, y)
    cache = ErasureCache(None)
    cache.eraser("k", fit)
    cache.eraser("k", fit)
    assert fit.calls == 2


# --- through the data module: what a sweep's jobs do -----------------------------------------


def sweep_job(cache_dir: Path, seed: int = 0, data_seed: int = 0, eraser_options: dict | None = None, **overrides):
    from datamodules.datamodule import ErasedDataModule
    from datamodules.options import DataOptions

    options = {"num_classes": 3, "shape": [1, 4, 4], "n_train": 400, "n_test": 100, "mean_shift": 2.0}
    data = {
        "source": "synthetic",
        "options": options,
        "val_size": 100,
        "test_size": 0,
        "device": "cpu",
        "cache_dir": str(cache_dir),
        **overrides,
    }
    eraser = {"name": "leace", "options": eraser_options or {}}
    dm = ErasedDataModule(DataOptions.from_config(data, eraser, data_seed=data_seed), seed=seed)
    dm.setup()
    return dm


class Spy:
    """Counts calls of a real function and passes them through."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_sweep_jobs_share_fitted_erasers_and_erased_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datamodules.erasing as erasing
    import datamodules.splits as splits

    fits, loads = Spy(erasing.fit_eraser), Spy(splits.load_source)
    monkeypatch.setattr(erasing, "fit_eraser", fits)
    monkeypatch.setattr(splits, "load_source", loads)

    first = sweep_job(tmp_path, seed=0)
    assert (fits.calls, loads.calls) == (1, 1)
    second = sweep_job(tmp_path, seed=1)  # another model seed of the same sweep: same data
    assert (fits.calls, loads.calls) == (1, 1), "a cache hit must fit nothing and not even load the source"
    assert torch.equal(first.train_set.x, second.train_set.x) and torch.equal(first.val_set.x, second.val_set.x)
    assert first.classes == second.classes and second.eraser is not None

    sweep_job(tmp_path, eraser_options={"batch_size": 64})  # a changed eraser option refits
    assert fits.calls == 2
    sweep_job(tmp_path, data_seed=1)  # another split refits
    assert fits.calls == 3
    sweep_job(tmp_path, augment_order="augment_then_erase")  # new erased data, same fitted eraser
    assert fits.calls == 3 and loads.calls == 4


def test_data_made_by_other_eraser_code_is_not_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys carry the digest of erasure/ and datamodules/: after an edit to an eraser the cache
    fits again instead of serving what the old code made (it served it before)."""
    import datamodules.cache as cache_module
    import datamodules.erasing as erasing
    from erasure.files import source_digest

    assert len(source_digest(cache_module.ERASURE_CODE_PACKAGES)) == 64
    fits = Spy(erasing.fit_eraser)
    monkeypatch.setattr(erasing, "fit_eraser", fits)
    monkeypatch.setattr(cache_module, "source_digest", lambda packages: "old eraser code")
    sweep_job(tmp_path, seed=0)
    sweep_job(tmp_path, seed=1)
    assert fits.calls == 1  # one code version: shared
    monkeypatch.setattr(cache_module, "source_digest", lambda packages: "edited eraser code")
    sweep_job(tmp_path, seed=0)
    assert fits.calls == 2
