"""kvdoctor's terminal UI: a live (or replayed) view of the KV cache, its tiers, and the findings.

``state.Monitor`` folds events into what the screens show (block ownership and tiers through
the checks' own ``Ledger``, so the map and the findings agree), ``feed`` runs it and the checks
on a worker thread over any ``kvdoctor.session.Source``, ``app.KvdoctorApp`` draws the snapshots. Only ``app`` and ``widgets``
import Textual, so the state model and the feeds can be benchmarked and tested without it.
"""

__all__ = ["app", "feed", "state", "synthetic", "workload", "screenshot"]
