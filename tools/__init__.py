"""Developer tools run from a source checkout (`python -m tools.train`); not installed with k3serve."""
