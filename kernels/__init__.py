"""Triton kernels of titan_lowbit, each with a pure-PyTorch reference of the same math."""
