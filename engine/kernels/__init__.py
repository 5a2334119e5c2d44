"""Native kernels: the C sources compiled for this CPU on first use, and the loader that builds them."""
