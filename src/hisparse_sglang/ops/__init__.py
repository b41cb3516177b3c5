"""Kernels: ``reference`` (pure PyTorch, the specification) and ``swap_in`` (CUDA, compiled on first use)."""
