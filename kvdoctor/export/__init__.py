"""Exports: a kvdoctor trace turned into formats other tools show (Perfetto / chrome://tracing)."""

from .perfetto import export_perfetto, perfetto_events

__all__ = ["export_perfetto", "perfetto_events"]
