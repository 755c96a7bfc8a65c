"""torch with one function that runs out of memory: how tests make a worker's own failure (an
allocation, as on a GPU) at a chosen point of a round."""
import torch


class NoMemory:
    """torch, but ``short`` runs out of memory: at every call, or, given ``fail``, at the first
    call once ``fail`` holds something (which it then clears). ``sized``: only a call whose
    first argument, a size, is not zero (an empty tensor takes no memory)."""

    def __init__(self, short: str = "cat", fail: list | None = None, sized: bool = False):
        self._short, self._fail, self._sized = short, fail, sized

    def __getattr__(self, name):
        real = getattr(torch, name)
        if name != self._short:
            return real

        def out_of_memory(*a, **k):
            armed = self._fail is None or bool(self._fail)
            if armed and not (self._sized and a and not a[0]):
                if self._fail:
                    self._fail.clear()
                raise MemoryError(f"out of memory in {self._short}")
            return real(*a, **k)
        return out_of_memory
