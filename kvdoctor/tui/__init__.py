"""kvdoctor's terminal UI: a live (or replayed) view of the KV cache, its tiers, and the findings.

``state.Monitor`` folds events into what the screens show, ``feed`` runs it and the checks
on a worker thread, ``app.KvdoctorApp`` draws the snapshots. Only ``app`` and ``widgets``
import Textual, so the state model and the feeds can be benchmarked and tested without it.
"""

__all__ = ["app", "feed", "state", "synthetic", "workload", "screenshot"]
