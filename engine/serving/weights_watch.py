"""What computes K/V in a runner: a ``weights`` event when the model's parameters change under a live cache.

K/V are a function of the weights that computed them. The prefix cache's salt carries a digest of the weights
taken when the runner was built (``kv.prefix.model_salt``), so a model edited afterwards (a training step's
copy into it, ``load_state_dict``, an in-place update through ``Runner.update_weights``) would otherwise hit
blocks computed by the old weights: the RL weight-sync bug. The watch makes the change explicit: a ``weights``
event (version, what did it, the new digest), and the prefix cache salted with the new digest from then on, so
requests after the change compute their own K/V and requests before it keep theirs.

An edit is seen by the parameters' version counters, which every in-place operation on a parameter (or a view
of it, as the runner's fused weights are) advances: one pass over a few hundred integers per step. A write
through ``.data`` advances no counter; ``Runner.update_weights`` reports what it did whatever it was.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from ...events import Weights
from ..bus import Bus
from ..kv.cache import PagedKVCache
from ..kv.prefix import model_salt

__all__ = ["WeightsWatch"]

_VERSION = attrgetter("_version")  # a parameter's in-place version counter, read without a Python frame per parameter


class WeightsWatch:
    """The weights version of one runner's model; ``check`` before each step, ``changed`` after an update."""

    def __init__(self, model: Any, cache: PagedKVCache, bus: Bus) -> None:
        self.model = model
        self.cache = cache
        self.bus = bus
        self.version = 0  # changes since the runner was built
        self._params = list(model.parameters())
        self._counters = self._counted()

    def _counted(self) -> int:
        return sum(map(_VERSION, self._params))

    def check(self) -> None:
        """Before a step: parameters edited in place since the last look are a change."""
        if self._counted() != self._counters:
            self.changed("the model's parameters were changed in place")

    def changed(self, detail: str) -> None:
        """The weights changed (``detail``: by what): a new version, the prefix cache salted with its digest."""
        self._counters = self._counted()
        digest = model_salt(self.model)["weights"]
        self.version += 1
        if self.cache.prefix is not None:
            self.cache.prefix.resalt(weights=digest)
        self.bus.emit(Weights, version=self.version, cause="update", detail=detail, digest=digest)
