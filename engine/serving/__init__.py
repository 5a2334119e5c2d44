"""Serving: continuous batching, preemption and speculative decoding over the runner."""
