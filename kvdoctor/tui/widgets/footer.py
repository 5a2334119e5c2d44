"""The footer: Textual's, rebuilt only when the keys it shows change.

Textual's footer is a widget per key, each styled anew, rebuilt whenever focus moves or the bindings are refreshed
(after the next screen refresh). A tab key moves focus twice (``KvdoctorApp.action_tab``) and most moves leave the
shown keys as they were; on a CPU the watched workload keeps busy, those rebuilds were a third of a tab key's time.
"""

from __future__ import annotations

from textual.screen import Screen
from textual.widgets import Footer

__all__ = ["KeysFooter"]


class KeysFooter(Footer):
    """A ``Footer`` whose queued rebuilds after a focus move do nothing while its keys stay the same."""

    def __init__(self) -> None:
        super().__init__()
        self._shown: tuple | None = None  # the keys as last composed

    async def recompose(self) -> None:
        keys = _keys(self.screen)
        if keys == self._shown:
            return
        self._shown = keys
        await super().recompose()


def _keys(screen: Screen) -> tuple:
    """The keys a footer would show on ``screen``, each with its action, label and whether it is enabled now."""
    return tuple((binding.key, binding.action, binding.description, enabled)
                 for _, binding, enabled, _ in screen.active_bindings.values() if binding.show)
