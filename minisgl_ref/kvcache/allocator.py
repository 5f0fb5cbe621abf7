"""Handing out KV memory a page at a time (chapter 03).

The KV pool is one big array of token *slots*; slot ``s`` lives in page ``s // page_size``. The allocator only
tracks which pages are free. Pages, not tokens, are the unit because attention kernels (and the radix cache with
page_size > 1) want a request's tokens in runs of ``page_size`` consecutive slots.

A request fills its last page before it gets a new one, so the slots for its next ``n`` tokens are: whatever is
left of its current page, then fresh pages. :meth:`alloc_tokens` computes exactly that.
"""

from __future__ import annotations

import torch


class OutOfPages(RuntimeError):
    """Raised when an allocation cannot be satisfied; the scheduler evicts or retracts and tries again."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token, got {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        # A stack of free page ids. Page 0 is never handed out: slot 0 is the "dummy" slot that padded batch
        # entries (CUDA graphs, chapter 08) may write to without corrupting anyone's KV.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))

    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def pages_needed(self, seq_len: int, new_tokens: int) -> int:
        """Fresh pages a request of ``seq_len`` tokens needs to grow by ``new_tokens``."""
        ps = self.page_size
        return -(-(seq_len + new_tokens) // ps) - (-(-seq_len // ps))

    def alloc_pages(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        out = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return out[::-1]

    # BEGIN TASK 3.1: allocate slots for a request's next tokens
    def alloc_tokens(self, seq_len: int, last_slot: int, new_tokens: int) -> torch.Tensor:
        """Slots for tokens ``seq_len .. seq_len + new_tokens - 1`` of a request whose token ``seq_len - 1`` sits
        in ``last_slot`` (ignored when ``seq_len`` is a multiple of the page size: the last page is full)."""
        ps = self.page_size
        used_in_last = seq_len % ps
        tail = min(new_tokens, ps - used_in_last) if used_in_last else 0
        pages = self.alloc_pages(self.pages_needed(seq_len, new_tokens))
        # Plain Python lists and one tensor at the end: this runs once per request per decode step, where a
        # handful of tiny torch ops (~3 us each) would add up to milliseconds at a batch of 256.
        slots = list(range(last_slot + 1, last_slot + 1 + tail))
        if ps == 1:
            slots += pages
        else:
            slots += [p * ps + i for p in pages for i in range(ps)][: new_tokens - tail]
        return torch.tensor(slots, dtype=torch.int64)
    # END TASK 3.1

    def free_slots(self, slots: torch.Tensor | list[int]) -> None:
        """Return the pages that ``slots`` occupy. ``slots`` must cover whole pages the caller owns; with
        page_size > 1 a page is freed once, through its first slot."""
        s = torch.as_tensor(slots, dtype=torch.int64).flatten().cpu()
        if s.numel() == 0:
            return
        pages = torch.unique(s // self.page_size).tolist()
        if 0 in pages:
            raise ValueError("slot 0 is the reserved dummy slot and was never allocated")
        self._free.extend(pages)
