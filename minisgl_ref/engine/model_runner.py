"""Runs one scheduled batch on the device: metadata, forward, logits, sampling (chapters 03, 07, 08).

Everything here is device work plus the minimum of host-to-device copies; nothing waits for the device. The
sampled tokens stay on the device in ``token_buffer`` (indexed by page-table row), which is where the next decode
step reads its input ids from: that is what lets the CPU schedule step N+1 before it has seen step N's tokens
(chapter 06).

Per-step host work is the enemy on small models (chapter 08, "per-token costs"): a decode step of Qwen3-0.6B at
batch 1 takes ~2 ms of GPU time, so a Python loop that launches a few tiny copies per request, or one hidden
device-to-host sync, makes the GPU wait. Hence the shape of :meth:`ModelRunner.prepare`:

* every host-side number a step needs (input ids, positions, KV slots, page-table rows, sequence lengths, the
  index of each request's last token) goes into **one** int64 CPU tensor, copied to the device in **one**
  non-blocking transfer from pinned memory, then sliced into views;
* the scheduler writes new KV slots only into the host copy of the page table; the runner writes the whole
  step's new slots into the device table with one scatter;
* decode-only steps take a vectorised path with no per-request Python work beyond reading two lists;
* the sampling state is reused across decode steps of the same requests (only the step counter moves:
  :mod:`~minisgl_ref.engine.sampling_state`).

Which attention backend a step runs on, and so which captured CUDA graphs may replay it, is the attention
planner's choice (:mod:`~minisgl_ref.engine.attention_planner`); the runner offers each step to its graph runners
(:mod:`~minisgl_ref.engine.graphs`) in order and runs it eagerly if none takes it.

Log probabilities (chapter 10) are computed only in steps where some request asked for them: those of the sampled
tokens by the sampler, a prompt's from the hidden states of its positions (:mod:`~minisgl_ref.engine.prompt_logprobs`).

The only wait for the device per step is the engine's ``StepOutput.tokens()``, one step late under overlap; on a GPU it
waits for an event recorded right after this step's token copy, not for the step launched after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
from minisgl_ref.engine.attention_planner import AttentionPlanner
from minisgl_ref.engine.graphs import GraphRunner, GraphSettings, capture_graphs
from minisgl_ref.engine.guess_rows import prepare_with_guesses, split_row_logits
from minisgl_ref.engine.prompt_logprobs import PromptLogprobPlan, compute_prompt_logprobs
from minisgl_ref.engine.sampling_state import SamplingState
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
from minisgl_ref.sampling.sampler import Sampler, StepLogprobs, to_device

#: On CUDA, extend steps run with a token count rounded up to a multiple of this (:meth:`ModelRunner.pad_extend`).
EXTEND_TOKEN_MULTIPLE = 64


@dataclass
class StepOutput:
    """What a launched step produces. It lives on the device until :meth:`tokens` reads the sampled tokens back."""

    forward_batch: ForwardBatch  # the device inputs the step ran with
    next_tokens: torch.Tensor  # [B] on the device
    # Log probabilities, only in steps where some request asked for them (chapter 10): of each row's sampled
    # token, and of the prompt positions that the plan lists.
    logprobs: StepLogprobs | None = None
    prompt_logprobs: tuple[PromptLogprobPlan, StepLogprobs] | None = None
    # On a GPU, a copy of the tokens in pinned host memory, and the event that marks the end of that copy.
    host_tokens: torch.Tensor | None = None
    copy_done: torch.cuda.Event | None = None
    # The logits [M, V] at every position of the rows that feed a guess (chapter 13), row after row, in the
    # model's dtype on the device; None when no row does.
    row_logits: torch.Tensor | None = None

    def tokens(self) -> list[int]:
        """The sampled tokens on the host: the one wait for the device per step.

        On a GPU this waits for *this* step's copy event only. ``next_tokens.tolist()`` would queue its copy on
        the stream behind everything launched since, which under overlap is the whole next step: the CPU would
        then wait for step N+1 to finish before it could process step N, and the GPU would idle while the CPU
        processed, scheduled and launched (a quarter of every decode step on an H100, chapter 11)."""
        if self.copy_done is not None and self.host_tokens is not None:
            self.copy_done.synchronize()
            return self.host_tokens.tolist()
        return self.next_tokens.tolist()


class ModelRunner:
    """Turns a :class:`ScheduledBatch` into device work and returns a :class:`StepOutput`.

    ``planner`` chooses each step's attention backend (``planner.backend`` is the engine's). ``graphs`` says which
    CUDA graphs to capture (CUDA only): decode steps padded to batch sizes up to ``graphs.decode_max_bs``, one set
    per decode backend of the planner, and extend steps. Steps that no graph takes, and every step on the CPU, run
    eagerly. ``extend_token_multiple``: see :meth:`pad_extend`."""

    def __init__(self, model: nn.Module, vocab_size: int, req_to_token: ReqToTokenPool, planner: AttentionPlanner,
                 device: torch.device, *, graphs: GraphSettings = GraphSettings(),
                 extend_token_multiple: int | None = None) -> None:
        self.model = model
        self.req_to_token = req_to_token
        self.planner = planner
        self.attn_backend = planner.backend  # every step's backend until the planner picks another
        self.device = device
        self.sampler = Sampler()
        self.token_buffer = torch.zeros(req_to_token.max_requests, dtype=torch.int64, device=device)
        self.sampling = SamplingState(vocab_size, device, self.token_buffer)
        self._pin = device.type == "cuda"  # pinned host memory makes the H2D copy truly asynchronous
        # The device page table needs the runner's scatter only when it is not the host table itself.
        self._table_on_device = req_to_token.table is not req_to_token.host
        # Extend steps run with a token count rounded up to this multiple (see pad_extend). The padding row's
        # device constants are made once: zeros (ids, slots, page-table row) and 0 .. multiple (positions, length).
        multiple = extend_token_multiple or (EXTEND_TOKEN_MULTIPLE if device.type == "cuda" else 1)
        if multiple < 1:
            raise ValueError(f"extend_token_multiple must be >= 1, got {multiple}")
        self.extend_token_multiple = multiple
        self._pad_zeros = torch.zeros(multiple, dtype=torch.int64, device=device)
        self._pad_range = torch.arange(multiple, dtype=torch.int64, device=device)
        self.graph_runners: list[GraphRunner] = capture_graphs(model, planner, device, graphs, multiple)

    def release_graphs(self) -> None:
        """Drop every captured CUDA graph (all the graph runners); later steps run eagerly.

        With tensor parallelism a graph holds the all-reduces it captured, and NCCL keeps a communicator alive
        until each graph that uses it is destroyed: a rank that destroys its communicator first waits for ever."""
        self.graph_runners = []

    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        """Flatten the scheduled rows into one :class:`ForwardBatch`: [T] input ids, positions and KV slots for the
        T new tokens of the step (row after row, each row's tokens in order), and [B] per-row tensors.

        Row ``i`` (``batch.rows[i]``) computes tokens ``prefix_len .. prefix_len + extend_len - 1`` of its request,
        whose page-table row is ``req.req_pool_idx``; the scheduler has already written the KV slots of those
        tokens into the host copy of the page table (``self.req_to_token.host[row, position]``). Fill in:

        * ``input_ids`` [T]: the tokens ``req.all_ids[prefix_len : prefix_len + extend_len]``, except for decode
          rows (``row.is_decode``): their one input token was sampled on the device by the previous step and may
          not have reached the CPU yet (under overlap, chapter 06, it is not in ``all_ids``), so it is read on
          the device from ``self.token_buffer[req_pool_idx]``;
        * ``positions`` [T]: each token's position in its request, ``prefix_len ..``, not 0 ..;
        * ``out_cache_loc`` [T]: the slot each new token's K and V go to: the page-table entries at those
          positions;
        * ``req_pool_indices``, ``seq_lens`` (prefix + new tokens) and ``last_token_indices`` (the index of each
          row's last new token in the flat [T] layout, whose logits are sampled) [B]; ``extend_lens_cpu`` and
          ``prefix_lens_cpu`` as Python lists; ``mode`` DECODE if every row decodes, else EXTEND.

        The tensors go to ``self.device`` (on a GPU: from one pinned host tensor in one copy). When the device
        page table is not the host copy (``self._table_on_device``), write the step's new slots into it
        (``self.req_to_token.table[row, position] = slot`` for every new token): the attention kernels read that
        one, and the scheduler wrote only the host copy."""
        # BEGIN TASK 3.3: build the forward batch
        rows = [row.req.req_pool_idx for row in batch.rows]
        prefix_lens = [row.prefix_len for row in batch.rows]
        extend_lens = [row.extend_len for row in batch.rows]
        host_table = self.req_to_token.host
        rows_t = torch.tensor(rows, dtype=torch.int64)
        if batch.is_decode:
            # One token per request, at position prefix_len: no per-request loop at all.
            pos_t = torch.tensor(prefix_lens, dtype=torch.int64)
            ids_t = torch.full_like(pos_t, -1)
            slots_t = host_table[rows_t, pos_t].to(torch.int64)
            token_rows_t, last_t = rows_t, torch.arange(len(rows), dtype=torch.int64)
        else:
            ids: list[int] = []
            positions: list[int] = []
            token_rows: list[int] = []  # each token's page-table row
            slots: list[torch.Tensor] = []
            for row in batch.rows:
                start, end = row.prefix_len, row.prefix_len + row.extend_len
                ids.extend([-1] if row.is_decode else row.req.all_ids[start:end])
                positions.extend(range(start, end))
                token_rows.extend([row.req.req_pool_idx] * row.extend_len)
                slots.append(host_table[row.req.req_pool_idx, start:end])
            pos_t = torch.tensor(positions, dtype=torch.int64)
            ids_t = torch.tensor(ids, dtype=torch.int64)
            slots_t = torch.cat(slots).to(torch.int64)
            # Built in Python, not with torch.repeat_interleave: on a 16-core host that took ~3.6 ms for a step of
            # a dozen rows (its parallel path), more than the whole replayed step (chapter 11).
            token_rows_t = torch.tensor(token_rows, dtype=torch.int64)
            last_t = torch.tensor(extend_lens, dtype=torch.int64).cumsum(0) - 1
        seq_lens_t = torch.tensor(prefix_lens, dtype=torch.int64) + torch.tensor(extend_lens)
        # One host tensor, one copy: [ids | positions | slots | token rows | rows | seq lens | last index].
        host = torch.cat([ids_t, pos_t, slots_t, token_rows_t, rows_t, seq_lens_t, last_t])
        if self._pin:
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        t, b = ids_t.shape[0], len(rows)
        ids_d, pos_d, slots_d, token_rows_d, rows_d, seq_lens_d, last_d = dev.split([t, t, t, t, b, b, b])
        if self._table_on_device:
            # The scheduler wrote these slots into the host page table only; the kernels read the device one.
            self.req_to_token.table[token_rows_d, pos_d] = slots_d.to(torch.int32)
        # Decode rows take the token sampled by the previous step, straight from the device buffer.
        input_ids = ids_d if not batch.is_decode else self.token_buffer[rows_d]
        if not batch.is_decode and any(row.is_decode for row in batch.rows):
            input_ids = torch.where(ids_d < 0, self.token_buffer[token_rows_d], ids_d)
        fb = ForwardBatch(
            mode=ForwardMode.DECODE if batch.is_decode else ForwardMode.EXTEND,
            input_ids=input_ids,
            positions=pos_d,
            extend_lens_cpu=extend_lens,
            prefix_lens_cpu=prefix_lens,
            attn_backend=self.attn_backend,
            req_pool_indices=rows_d,
            out_cache_loc=slots_d,
            seq_lens=seq_lens_d,
            last_token_indices=last_d,
        )
        return fb
        # END TASK 3.3

    def pad_extend(self, fb: ForwardBatch) -> ForwardBatch:
        """Round an extend step's token count up to a multiple of ``self.extend_token_multiple`` with one padding
        row: ``pad`` dummy tokens (token 0 at positions 0 .. pad - 1) of a request with nothing cached, reading
        page-table row 0 and writing their K and V to the reserved slot 0, as the CUDA-graph padding rows of
        chapter 08 do. The padding row comes last, after every real token and row, so ``last_token_indices`` and
        the sampled rows do not change: its tokens are computed and never read. Decode steps are returned as
        they are (they have CUDA graphs, padded by batch size).

        Why: cuBLAS chooses a matmul kernel per shape, and on an H100 host the first call with a new token count
        costs ~250-400 us more than a repeated one, for each of the ~110 matmuls of an eager step of a 28-layer
        model. Prompts of random lengths made almost every prefill step pay that (tens of ms, chapter 11,
        section 11); rounded to 64 tokens there are few shapes, and at most 63 dummy tokens per step.

        The page-table scatter of :meth:`prepare` has already run, so the padding never writes row 0; it only
        reads it (whatever slots are there: every entry of the table is a valid slot)."""
        t = fb.input_ids.shape[0]
        pad = -t % self.extend_token_multiple
        if pad == 0 or fb.mode.is_decode:
            return fb
        assert fb.out_cache_loc is not None and fb.req_pool_indices is not None and fb.seq_lens is not None
        zeros, ramp = self._pad_zeros, self._pad_range
        fb.input_ids = torch.cat([fb.input_ids, zeros[:pad]])
        fb.positions = torch.cat([fb.positions, ramp[:pad]])
        fb.out_cache_loc = torch.cat([fb.out_cache_loc, zeros[:pad]])
        fb.req_pool_indices = torch.cat([fb.req_pool_indices, zeros[:1]])
        fb.seq_lens = torch.cat([fb.seq_lens, ramp[pad : pad + 1]])
        fb.extend_lens_cpu = [*fb.extend_lens_cpu, pad]
        fb.prefix_lens_cpu = [*fb.prefix_lens_cpu, 0]
        fb.extend_masks = None if fb.extend_masks is None else [*fb.extend_masks, None]  # padding: causal
        return fb

    # ------------------------------------------------------------------------------------------------- running

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, prompt_plan: PromptLogprobPlan | None = None
    ) -> tuple[torch.Tensor, StepLogprobs | None]:
        """Logits [B, V] (in the model's dtype) of each request's last new token: a CUDA-graph replay when one
        takes the step. With a ``prompt_plan`` (extend steps only), also the log probabilities of the prompt
        tokens it names (never in a graph); with ``fb.extra_logit_indices``, the logits there follow the B rows."""
        extra = fb.extra_logit_indices
        for graphs in self.graph_runners if prompt_plan is None else ():
            if extra is None and graphs.can_run(fb):
                return graphs.replay(fb), None
            if extra is not None and graphs.can_run_all_positions(fb):  # the LM head at every drafted position
                last = graphs.replay(fb)
                return torch.cat([last, self.model.compute_logits(graphs.hidden_states(fb)[extra])]), None
        fb.attn_backend.init_forward_metadata(fb)  # the engine's backend, or the one the planner chose
        hidden = self.model(fb.input_ids, fb.positions, fb)
        logprobs = compute_prompt_logprobs(self.model, hidden, prompt_plan, self.device) if prompt_plan else None
        if not fb.mode.is_decode:
            hidden = hidden[fb.last_token_indices if extra is None else torch.cat([fb.last_token_indices, extra])]
        return self.model.compute_logits(hidden), logprobs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, before_sampling: Callable[[torch.Tensor], None] | None = None) -> StepOutput:
        """Launch the batch. Nothing here waits for the device: the result's tokens are read by the engine.

        ``before_sampling`` (a step with constrained rows, chapter 12) is called with the logits [B, V] after the
        forward pass has been launched and before sampling: it may wait for the previous step's tokens and mask
        the logits in place."""
        fb = self.pad_extend(prepare_with_guesses(self.prepare, batch))  # rows with a guess: chapter 13
        rows = fb.req_pool_indices[: len(batch.rows)]  # the real rows (an extend step may end with a padding row)
        self.planner.plan(batch, fb)  # which attention backend (and so which graphs) this step runs on
        plan = PromptLogprobPlan.of(batch) if not batch.is_decode else None
        logits, prompt_logprobs = self.forward(fb, plan)
        logits, row_logits = split_row_logits(logits, fb)  # the rows' last tokens', and a guess's every one
        info = self.sampling.info(batch)
        if before_sampling is not None:
            before_sampling(logits)
        # -1: nobody asked for log probabilities in this step (the common case: not a single extra kernel)
        top_k = max((r.logprobs.top for r in batch.reqs if r.logprobs is not None), default=-1)
        next_tokens, logprobs = self.sampler.sample(logits, info, top_k)
        # Rows that emit a token publish it where the next decode step will look for it.
        emits = [row.emits for row in batch.rows]
        if all(emits):
            self.token_buffer[rows] = next_tokens
        elif any(emits):
            idx = to_device(torch.tensor([i for i, e in enumerate(emits) if e]), self.device)
            self.token_buffer[rows[idx]] = next_tokens[idx]
        host_tokens = copy_done = None
        if next_tokens.is_cuda:
            # Start the device-to-host copies now, in stream order right after sampling, and mark their end with
            # an event: the engine waits for that event, not for whatever is launched after this step.
            host_tokens = _to_pinned_host(next_tokens)
            logprobs = logprobs.to(_to_pinned_host) if logprobs is not None else None
            prompt_logprobs = prompt_logprobs.to(_to_pinned_host) if prompt_logprobs is not None else None
            copy_done = torch.cuda.Event()
            copy_done.record()
        prompt = (plan, prompt_logprobs) if plan is not None and prompt_logprobs is not None else None
        return StepOutput(fb, next_tokens, logprobs, prompt, host_tokens, copy_done, row_logits)


def _to_pinned_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor into pinned host memory, in stream order (read it after the step's event)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
