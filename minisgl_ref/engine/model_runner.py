"""Runs one scheduled batch on the device: metadata, forward, logits, sampling (chapters 03, 07, 08).

Everything here is device work plus the minimum of host-to-device copies; nothing waits for the device. The
sampled tokens stay on the device in ``token_buffer`` (indexed by page-table row), which is where the next decode
step reads its input ids from: that is what lets the CPU schedule step N+1 before it has seen step N's tokens
(chapter 06).
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_ref.attention.base import AttentionBackend
from minisgl_ref.engine.forward_batch import ForwardBatch, ForwardMode
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
from minisgl_ref.sampling.sampler import Sampler, SamplingBatchInfo
from minisgl_ref.scheduler.batch import ScheduledBatch


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        req_to_token: ReqToTokenPool,
        attn_backend: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.req_to_token = req_to_token
        self.attn_backend = attn_backend
        self.device = device
        self.sampler = Sampler()
        self.token_buffer = torch.zeros(req_to_token.max_requests, dtype=torch.int64, device=device)

    # BEGIN TASK 3.3: build the forward batch
    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        """Flatten the scheduled rows into [T] input ids, positions and KV slots."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        decode_at: list[int] = []  # flat indices whose input token is still on the device
        decode_rows: list[int] = []
        for req, start, n, is_decode in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.is_decode_row):
            assert req.req_pool_idx is not None
            if is_decode:
                decode_at.append(len(ids))
                decode_rows.append(req.req_pool_idx)
                ids.append(0)  # placeholder, filled from token_buffer below
            else:
                ids.extend(req.all_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.append(self.req_to_token.read(req.req_pool_idx, start + n, start))
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        if decode_at:
            rows = torch.tensor(decode_rows, dtype=torch.int64).to(dev, non_blocking=True)
            input_ids[torch.tensor(decode_at, device=dev)] = self.token_buffer[rows]
        return ForwardBatch(
            mode=ForwardMode.DECODE if batch.is_decode else ForwardMode.EXTEND,
            input_ids=input_ids,
            positions=torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True),
            extend_lens_cpu=list(batch.extend_lens),
            prefix_lens_cpu=list(batch.prefix_lens),
            attn_backend=self.attn_backend,
            req_pool_indices=torch.tensor([r.req_pool_idx for r in batch.reqs], dtype=torch.int64).to(dev),
            out_cache_loc=torch.cat(slots).to(dev, non_blocking=True),
        )
    # END TASK 3.3

    def sampling_info(self, batch: ScheduledBatch) -> SamplingBatchInfo:
        reqs = batch.reqs
        info = SamplingBatchInfo.build(
            params_list=[r.params for r in reqs],
            prompt_ids_list=[r.input_ids for r in reqs],
            output_ids_list=[r.output_ids for r in reqs],
            eos_token_ids_list=[r.eos_token_ids for r in reqs],
            vocab_size=self.vocab_size,
            device=self.device,
            seeds=[r.sampling_seed for r in reqs],
        )
        # With overlap, a request may have one token sampled on the device that its Python lists do not show
        # yet. Its sampling step and penalty counts must include it, or seeded streams and penalties would
        # differ from the non-overlapped engine.
        pending = [i for i, r in enumerate(reqs) if r.num_inflight > (1 if batch.emits[i] else 0)]
        if pending:
            rows = torch.tensor(pending, device=self.device)
            info.steps[rows] += 1
            if info.output_counts is not None:
                tokens = self.token_buffer[torch.tensor([reqs[i].req_pool_idx for i in pending], device=self.device)]
                info.output_counts[rows, tokens] += 1
        return info

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Launch the batch; returns the sampled tokens [B] (on the device; nobody waits for them here)."""
        fb = self.prepare(batch)
        batch.forward_batch = fb
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        logits = self.model.compute_logits(hidden[fb.last_token_indices])
        info = self.sampling_info(batch)
        batch.sampling_info = info
        next_tokens = self.sampler(logits, info)
        # Rows that emit a token publish it where the next decode step will look for it.
        emit_rows = [i for i, e in enumerate(batch.emits) if e]
        if emit_rows:
            idx = torch.tensor(emit_rows, device=self.device)
            self.token_buffer[fb.req_pool_indices[idx]] = next_tokens[idx]
        batch.next_tokens = next_tokens
        return next_tokens
