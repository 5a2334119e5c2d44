"""Model execution: loading weights, the runner's forward pass, paged attention, the compiled decode path."""
