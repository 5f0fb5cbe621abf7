"""Requests and their scheduling (chapters 00, 03-06)."""

from minisgl_ref.scheduler.request import FinishReason, Req

__all__ = ["FinishReason", "Req"]
