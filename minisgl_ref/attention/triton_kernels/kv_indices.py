"""Flatten page-table rows into ``kv_indices`` (the CSR layout every paged attention kernel reads).

The page table (:class:`~minisgl_ref.kvcache.req_to_token.ReqToTokenPool`) has one row per request slot; entry
``[r, i]`` is the KV-pool slot of the request's token ``i``. A batch needs, for request ``b``, the first
``lens[b]`` entries of row ``req_pool_indices[b]``. Laid end to end they form ``kv_indices``, and
``kv_indptr[b] .. kv_indptr[b + 1]`` is request ``b``'s part::

    page table row 7: [ 40 41 42 43 | 12 13 . . ]      lens = [6, 3]
    page table row 2: [ 90 91 92 . . . . . . . ]  ->   kv_indptr  = [0, 6, 9]
                                                       kv_indices = [40 41 42 43 12 13 90 91 92]

(page size 4 above: slots come in runs of 4, but the table is token-granular, so nothing downstream cares.)

Doing this with one small kernel instead of ``torch.cat([table[r, :n] for ...])`` matters for two reasons: no
Python loop over requests, and it needs no host-side lengths, so the CUDA-graph replay path (chapter 08) can
refill a static ``kv_indices`` buffer in place without a device-to-host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it then runs on the CPU, in numpy)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


@triton.jit
def _build_kv_indices_kernel(
    req_to_token,  # [max_requests, max_context] int32: the page table
    req_pool_indices,  # [B]: each request's row
    lens,  # [B]: how many leading entries of the row to copy
    kv_indptr,  # [B + 1]: where request b's entries start in kv_indices
    kv_indices,  # out: [>= kv_indptr[B]]
    stride_row,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    n = tl.load(lens + b).to(tl.int64)
    out_start = tl.load(kv_indptr + b).to(tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        slots = tl.load(req_to_token + row * stride_row + offs, mask=mask)
        tl.store(kv_indices + out_start + offs, slots, mask=mask)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """Fill ``kv_indices[kv_indptr[b] : kv_indptr[b] + lens[b]] = req_to_token[req_pool_indices[b], :lens[b]]``."""
    batch = req_pool_indices.shape[0]
    if batch == 0:
        return
    assert req_to_token.stride(1) == 1
    _build_kv_indices_kernel[(batch,)](
        req_to_token, req_pool_indices, lens, kv_indptr, kv_indices, req_to_token.stride(0), BLOCK=512
    )
