"""Model definitions only: no parallelism, no training code."""
