"""The page table: for every running request, the KV slot of each of its tokens (chapter 03).

A request slot ``r`` owns row ``r`` of a [max_requests, max_context] table; entry ``[r, i]`` is the KV-pool slot of
the request's i-th token. Attention backends read a request's keys and values through this row, so a request's
KV may be scattered anywhere in the pool: shared prefix pages from the radix cache first, its own pages after.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.table = torch.zeros(max_requests, max_context_len, dtype=torch.int32, device=device)
        self._free = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("no free request slot (max_running_requests reached)")
        return self._free.pop()

    def free(self, index: int) -> None:
        if index in self._free:
            raise ValueError(f"request slot {index} freed twice")
        self._free.append(index)

    def write(self, index: int, start: int, slots: torch.Tensor) -> None:
        self.table[index, start : start + len(slots)] = slots.to(self.table.device, torch.int32)

    def read(self, index: int, end: int, start: int = 0) -> torch.Tensor:
        return self.table[index, start:end].to(torch.int64)
