"""Device runtime doubles for tests (memfit.devices): pass one as ``device=`` to memfit.generate."""

from memfit.devices import CpuRuntime

__all__ = ["WeightsOnlyCpu"]


class WeightsOnlyCpu(CpuRuntime):
    """The CPU, with a process that holds nothing on it before memfit places weights (``memory_in_use`` is 0):
    a budget about a tiny model's size then counts what memfit places, not Python, torch and the libraries."""

    def memory_in_use(self) -> int:
        return 0
