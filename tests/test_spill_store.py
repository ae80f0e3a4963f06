"""The spill store's disk tier on its own: what is read back is what was stored, whatever the caller still holds."""

from __future__ import annotations

import resource

import torch

from lightning_varuna.spilling.store import SpillStore


def parts(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(256, 64, generator=generator), torch.randn(64, generator=generator)]


def test_a_part_still_in_use_is_never_read_over(tmp_path):
    """Reads reuse buffers; a part the caller still holds keeps its values while other parts are read, and a part
    stored again in place of a longer one reads back as the new one."""
    store = SpillStore(torch.device("cpu"), tmp_path)
    for key in "abc":
        store.put(key, parts(ord(key)))
    held = store.get("a")
    for _ in range(3):  # buffers freed by dropping "b" and "c" are reused; "a"'s is not
        for key in "bc":
            store.prefetch(key)
            for got, expected in zip(store.get(key), parts(ord(key))):
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for got, expected in zip(held, parts(ord("a"))):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    store.put("c", parts(ord("a"))[1:])  # shorter than the file it overwrites
    torch.testing.assert_close(store.get("c")[0], parts(ord("a"))[1], rtol=0, atol=0)
    assert (tmp_path / "c.bin").stat().st_size == 64 * 4  # the longer part's tail is cut off
    store.close()


def test_a_part_whose_storage_object_alone_is_kept_is_never_read_over(tmp_path):
    """Holding only a part's storage (as serializers such as `torch.save` do) keeps its buffer from being reused."""
    store = SpillStore(torch.device("cpu"), tmp_path)
    for key in "ab":
        store.put(key, parts(ord(key)))
    storage = store.get("a")[0].untyped_storage()
    before = storage.tolist()
    for _ in range(3):
        store.get("b")
    assert storage.tolist() == before
    store.close()


def test_reads_reuse_buffers_once_dropped(tmp_path):
    """Reading a 4 MiB part again and again, dropping it each time, reads into the same memory: the process takes no
    page faults for it (a new buffer per read would take one per 4 KiB page, 1024 per read)."""
    store = SpillStore(torch.device("cpu"), tmp_path)
    store.put("a", [torch.ones(2**20)])
    store.get("a")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        assert store.get("a")[0].sum().item() == 2**20
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 1024, f"{faults} page faults in 10 reads of 1024 pages"
    store.close()
