"""Turning scheduled requests into model forward passes (chapters 00, 03, 08)."""
