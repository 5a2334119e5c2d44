"""The TUI's widgets. Each renders from the ``Snapshot`` it is bound to and never reads the source."""
