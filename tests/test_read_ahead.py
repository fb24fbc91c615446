"""Issue 35, item 23: the weights check (same_samples) under a capped run waited for one small synchronous read per
tensor and place; the disk tier's samples are now advised ahead (MappedPages.prefetch_samples) before any is checked.
The advice must name exactly the places the check compares, page-aligned (madvise refuses anything else)."""

import mmap

import torch
from safetensors.torch import save_file

from memfit.run.offload import mapped_view
from memfit.safetensors_header import SAMPLE_COUNT, MappedFile, sample_starts


class _Recorder:
    closed = False

    def __init__(self):
        self.calls = []

    def madvise(self, option, start, length):
        self.calls.append((option, start, length))


def test_prefetch_samples_advises_each_place_the_check_compares(tmp_path):
    path = tmp_path / "weights.safetensors"
    # A small tensor first, so the large one starts at no page boundary.
    save_file({"a": torch.ones(3), "b": torch.arange(300_000, dtype=torch.float32)}, str(path))
    mapped = MappedFile(path)
    shared = mapped_view(mapped, "b")
    begin, end = mapped.byte_range("b")
    assert begin % mmap.PAGESIZE  # the case where rounding matters
    pages = shared.pages
    pages.prefetch_samples(shared.tensor.numel(), shared.tensor.element_size())  # the real mapping takes the advice

    recorder = _Recorder()
    pages.mapping = recorder
    pages.prefetch_samples(shared.tensor.numel(), shared.tensor.element_size())
    starts = sorted(sample_starts(300_000))
    assert len(recorder.calls) == len(starts) == 3
    for (option, start, length), first in zip(sorted(recorder.calls, key=lambda c: c[1]), starts):
        assert option == mmap.MADV_WILLNEED and start % mmap.PAGESIZE == 0
        place_begin, place_end = begin + first * 4, min(end, begin + (first + SAMPLE_COUNT) * 4)
        assert start <= place_begin < start + mmap.PAGESIZE and start + length == place_end
