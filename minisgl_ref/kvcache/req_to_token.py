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
        # A CPU copy that the scheduler reads and writes (chapter 08, "per-token costs"). Reading one entry of a
        # GPU tensor from Python waits for the GPU, and writing a few entries is a tiny copy of its own: done
        # once per request per step, that cost more than the decode step itself. The device table is the one
        # the attention kernels read; on the CPU the two are the same tensor.
        self.host = self.table if self.table.device.type == "cpu" else torch.zeros_like(self.table, device="cpu")
        self.host_np = self.host.numpy()  # the same memory, for single-entry reads and writes (~0.1 us, not ~3 us)
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

    def write(self, index: int, start: int, slots: torch.Tensor, *, device: bool = True) -> None:
        """Set entries ``start ..`` of row ``index``. ``device=False`` updates only the host copy: the caller
        promises that the device table gets these entries before any kernel reads them (the model runner
        writes every token of a step's batch in one scatter, see ``ModelRunner.prepare``)."""
        slots = slots.to(torch.int32)
        end = start + slots.shape[0]
        self.host[index, start:end] = slots
        if device and self.host is not self.table:
            # From pinned memory: a copy from pageable memory would wait for the step in flight (chapter 08).
            self.table[index, start:end] = slots.pin_memory().to(self.table.device, non_blocking=True)

    def read(self, index: int, end: int, start: int = 0) -> torch.Tensor:
        """Entries ``start .. end - 1`` of row ``index``, as int64 on the CPU (from the host copy: no wait)."""
        return self.host[index, start:end].to(torch.int64)
