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
        """Take ``n`` pages off the free list and return their ids; ``n = 0`` takes nothing and returns ``[]``.

        The free list ``self._free`` is a stack: take the ``n`` pages at its end, the most recently freed one
        first (so the page a request just gave back is the next one handed out, which keeps the chapter's
        pictures readable; any order would be correct). A page handed out must leave the list: a page that is
        both free and in use is later given to a second request, and two requests then overwrite each other's
        KV. If fewer than ``n`` pages are free raise :class:`OutOfPages` and take nothing: the scheduler then
        evicts or retracts and asks again."""
        # BEGIN TASK 3.1: allocate and free KV slots a page at a time
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        out = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return out[::-1]
        # END TASK 3.1

    def alloc_tokens(self, seq_len: int, last_slot: int, new_tokens: int) -> torch.Tensor:
        """Slots for tokens ``seq_len .. seq_len + new_tokens - 1`` of one request, as an int64 tensor of
        ``new_tokens`` slot ids in token order.

        The request's token ``seq_len - 1`` sits in ``last_slot``. If its last page is only partly used
        (``seq_len % page_size != 0``), the next tokens go into the rest of that page first: the slots right
        after ``last_slot``, since a page is ``page_size`` consecutive slots. Whatever does not fit there takes
        fresh pages from :meth:`alloc_pages` (:meth:`pages_needed` says how many), page ``p`` contributing slots
        ``p * page_size .. p * page_size + page_size - 1`` in order; the unused tail of the last fresh page stays
        with the request for its later tokens. When ``seq_len`` is a multiple of the page size (0 included) the
        last page is full and ``last_slot`` is ignored. So token ``i`` of a request always sits at offset
        ``i % page_size`` of its page. ``new_tokens = 0`` returns an empty tensor and takes no page; if the pages
        are not there, :meth:`alloc_pages` raises :class:`OutOfPages` before anything is taken."""
        # BEGIN TASK 3.1: allocate and free KV slots a page at a time
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
        """Give back the pages that ``slots`` occupy (slot ``s`` lies in page ``s // page_size``).

        ``slots`` (a tensor or a list, any shape) covers whole pages the caller owns: with page_size > 1 it
        names most pages several times (once per token), and each page must go back on the free list exactly
        once, or it would later be handed to two requests. Slot 0 lies in the dummy page, which is never handed
        out: freeing it is the caller's bug, so raise ``ValueError`` (mentioning the dummy slot) and free
        nothing."""
        s = torch.as_tensor(slots, dtype=torch.int64).flatten().cpu()
        if s.numel() == 0:
            return
        # BEGIN TASK 3.1: allocate and free KV slots a page at a time
        pages = torch.unique(s // self.page_size).tolist()
        if 0 in pages:
            raise ValueError("slot 0 is the reserved dummy slot and was never allocated")
        self._free.extend(pages)
        # END TASK 3.1
