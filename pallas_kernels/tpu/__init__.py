"""Pallas TPU kernels (Mosaic). None registered yet."""
