"""Pallas GPU kernels (Triton lowering). None registered yet."""
