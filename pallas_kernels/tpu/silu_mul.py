"""Pallas TPU kernel: silu_mul (in progress)."""
