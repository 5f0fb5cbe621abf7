"""Batched sampling: penalties, temperature, top-k / top-p / min-p, and seeded draws (chapter 02).

The model hands us one row of logits per running request, ``[B, V]``. Every request has its own
:class:`~minisgl_ref.sampling.params.SamplingParams`, yet the sampler must not loop over requests in Python: at a
batch of 256 a Python loop of small kernel launches costs more than the decode step it follows. So the per-request
knobs are packed once into ``[B]`` tensors (:class:`SamplingBatchInfo`) and every stage below is a handful of
whole-batch tensor ops in which a disabled knob is simply a no-op value (``top_k = V``, ``top_p = 1``,
``min_p = 0``, penalty 0 or 1).

The pipeline, per decode step::

    logits [B, V] --(+ logit_bias, OpenAI's per-token offsets)
                  --(task 2.2) penalties, min_new_tokens masking-->  penalised logits
        greedy rows:  argmax(penalised logits)
        other rows:   softmax(logits / T) in float32
                      --(task 2.3) top-k, then top-p, then min-p, renormalise--> probs
                      --(task 2.4) exponential race with hashed noise-->          token

Penalty semantics (OpenAI and vLLM conventions):

* ``repetition_penalty`` r (HF / CTRL style) applies to every token id that occurs in the prompt *or* in the
  output so far: a positive logit is divided by r, a non-positive one multiplied by r. r > 1 discourages
  repeats, r < 1 encourages them, r = 1 is off.
* ``frequency_penalty`` f and ``presence_penalty`` p count *generated* tokens only (not the prompt):
  ``logit -= f * count + p * (count > 0)`` where ``count`` is how often the id has been sampled so far.
* The repetition penalty is applied first, then the additive ones (vLLM's order; the two do not commute).
* ``min_new_tokens`` m: while a request has produced fewer than m tokens, the logits of its EOS ids and its
  ``stop_token_ids`` are set to ``-inf``. This holds whatever ``ignore_eos`` says: ``ignore_eos`` only tells the
  scheduler not to stop on EOS; it does not change the distribution. It yields to a grammar: where the grammar
  allows only stop ids (its answer is complete), they stay allowed, rather than leave no token to draw.
* Penalties apply to greedy rows too -- they change which token is the argmax.

Log probabilities, when a request asks for them, are those of the distribution its token was drawn from: the
logits after the logit bias and the penalties, divided by the temperature (by 1 for greedy rows), before top-k /
top-p / min-p truncation -- what SGLang reports. They are computed for the whole batch in one ``log_softmax``
only in steps where some row asked, so the common case pays nothing.

Reproducibility: the random numbers for request i at its step s over vocab id v are a pure function
``hash(seed_i, s, v)``, computed with integer tensor arithmetic. A request's tokens therefore depend on its seed and
its own logits only -- not on its row in the batch, the other requests, the device, or how many draws happened
before -- which is what makes a seeded request replayable under continuous batching.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from minisgl_ref.sampling import fused_draw
from minisgl_ref.sampling.params import GREEDY_TEMPERATURE_EPS, MAX_TEMPERATURE, SamplingParams

# ----------------------------------------------------------------------------------------------------------------
# Integer hashing on int64 tensors, without overflow.
#
# PyTorch has no general-purpose uint32/uint64 arithmetic on every device, and signed int64 overflow is undefined
# behaviour in C++ even though it usually wraps. We therefore keep every value in [0, 2**32) inside int64 tensors
# and multiply only by constants below 2**31: the product is below 2**63 and never overflows; masking with
# 0xFFFFFFFF then gives exact arithmetic modulo 2**32, bit-identical on CPU and GPU. On non-negative values ``>>``
# is a logical shift, so shifts need no masking either.
# ----------------------------------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31 with good avalanche for the xorshift-multiply construction below (from the
# published searches for 32-bit integer hashes); odd means the multiply is a bijection modulo 2**32.
_HASH_MUL_1 = 0x21F0AAAD
_HASH_MUL_2 = 0x735A2D97
# Arbitrary odd salts that separate the different uses of the same hash.
_SALT_SEED = 0x3C6EF372
_SALT_KEY2 = 0x1B873593


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` and ``c < 2**31``: the product fits in int64."""
    return (x * c) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Mix 32-bit values (stored in int64) so that each output bit depends on every input bit.

    Two rounds of xorshift-multiply. Every step is a bijection on [0, 2**32), so distinct inputs never collide.
    """
    x = x ^ (x >> 16)
    x = _mul32(x, _HASH_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _HASH_MUL_2)
    x = x ^ (x >> 15)
    return x


def seed_to_int64(seed: int) -> int:
    """Any Python int -> the int64 with the same low 64 bits (so seeds >= 2**63 and negative seeds are fine)."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


# ----------------------------------------------------------------------------------------------------------------
# The batch state.
# ----------------------------------------------------------------------------------------------------------------


class _Flag(IntEnum):
    """Columns of ``SamplingBatchInfo.row_flags``: which stages a row needs."""

    GREEDY = 0
    TOP_K = 1  # set only on non-greedy rows: greedy rows never reach the filtering stage
    TOP_P = 2
    MIN_P = 3
    FREQ_PRES = 4
    REPETITION = 5
    MIN_NEW_TOKENS = 6
    LOGIT_BIAS = 7


# Per-row tensors of shape [B]; filter() treats them all alike.
_ROW_FIELDS = (
    "temperatures",
    "top_ks",
    "top_ps",
    "min_ps",
    "frequency_penalties",
    "presence_penalties",
    "repetition_penalties",
    "seeds",
    "steps",
    "min_new_tokens",
)
# Per-row state of shape [B, V], allocated only when some row needs it (it is B * V elements: 40M at B=256 for a
# 152k vocabulary). A row whose params make a state irrelevant may hold zeros there.
_STATE_FIELDS = ("output_counts", "prompt_mask", "stop_token_mask", "logit_bias")


@dataclass
class SamplingBatchInfo:
    """Everything the sampler needs about a batch, as tensors on the logits' device.

    Build it when the batch's requests change (:meth:`build`; new requests joining a running batch mean a new
    build, from each request's parameters, prompt and output so far), call :meth:`update` after every sampling
    step, and :meth:`filter` when requests finish -- neither of those touches Python lists of tokens again.

    The ``need_*`` flags let a cheap batch skip work (an all-greedy batch never calls softmax). They are computed from
    ``row_flags``, a small CPU tensor, so reading them never waits for the device -- which matters once the CPU runs
    ahead of the GPU (chapter 06).
    """

    vocab_size: int
    temperatures: torch.Tensor  # [B] float32 (greedy rows hold their raw value; the sampler ignores it)
    top_ks: torch.Tensor  # [B] int64, "off" (-1) stored as vocab_size so that `rank < top_k` keeps all
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64, the low 64 bits of each request's seed
    steps: torch.Tensor  # [B] int64, tokens generated so far = index of the token being sampled
    min_new_tokens: torch.Tensor  # [B] int64
    row_flags: torch.Tensor  # [B, len(_Flag)] bool, on the CPU
    output_counts: torch.Tensor | None = None  # [B, V] int32: how often each id was generated
    prompt_mask: torch.Tensor | None = None  # [B, V] bool: id occurs in the prompt
    stop_token_mask: torch.Tensor | None = None  # [B, V] bool: EOS ids and stop_token_ids
    logit_bias: torch.Tensor | None = None  # [B, V] float32: added to the logits before anything else

    # -- construction ----------------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        prompt_ids_list: Sequence[Sequence[int]],
        output_ids_list: Sequence[Sequence[int]] | None,
        eos_token_ids_list: Sequence[Sequence[int] | int | None] | None,
        vocab_size: int,
        device: torch.device | str = "cpu",
        seeds: Sequence[int] | None = None,
    ) -> SamplingBatchInfo:
        """Pack per-request params and token history into batch tensors.

        ``output_ids_list`` holds tokens already generated (non-empty when a request is resumed); ``None`` means
        none yet. ``eos_token_ids_list`` holds each request's EOS id(s), masked while ``min_new_tokens`` is not
        reached. ``seeds`` overrides every row's seed; otherwise requests with ``seed=None`` get a fresh seed
        from torch's default CPU generator here, so unseeded
        requests differ run to run (unless the program calls ``torch.manual_seed``).
        """
        batch = len(params_list)
        if output_ids_list is None:
            output_ids_list = [[] for _ in range(batch)]
        if eos_token_ids_list is None:
            eos_token_ids_list = [None] * batch
        if not (len(prompt_ids_list) == len(output_ids_list) == len(eos_token_ids_list) == batch):
            raise ValueError("params_list, prompt_ids_list, output_ids_list and eos_token_ids_list differ in length")
        device = torch.device(device)
        v = vocab_size

        fresh = iter(torch.randint(0, 1 << 62, (batch,), dtype=torch.int64).tolist())
        if seeds is not None:
            # The engine drew each request's seed when the request arrived (Req.sampling_seed), so a rebuilt
            # batch continues the same random streams.
            seeds = [seed_to_int64(x) for x in seeds]
        else:
            seeds = [seed_to_int64(p.seed) if p.seed is not None else next(fresh) for p in params_list]

        def flag_row(p: SamplingParams) -> list[bool]:
            greedy = p.is_greedy
            row = [False] * len(_Flag)
            row[_Flag.GREEDY] = greedy
            row[_Flag.TOP_K] = not greedy and 1 <= p.top_k < v
            row[_Flag.TOP_P] = not greedy and p.top_p < 1.0
            row[_Flag.MIN_P] = not greedy and p.min_p > 0.0
            row[_Flag.FREQ_PRES] = p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            row[_Flag.REPETITION] = p.repetition_penalty != 1.0
            row[_Flag.MIN_NEW_TOKENS] = p.min_new_tokens > 0
            row[_Flag.LOGIT_BIAS] = bool(p.logit_bias)
            return row

        # One tensor from a Python list: per-element tensor writes cost ~20 us each, which adds up every step.
        flags = torch.tensor([flag_row(p) for p in params_list], dtype=torch.bool).reshape(batch, len(_Flag))

        def row(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype), device)

        f32, i64 = torch.float32, torch.int64
        info = cls(
            vocab_size=v,
            temperatures=row([min(p.temperature, MAX_TEMPERATURE) for p in params_list], f32),
            top_ks=row([v if p.top_k == -1 else min(p.top_k, v) for p in params_list], i64),
            top_ps=row([p.top_p for p in params_list], f32),
            min_ps=row([p.min_p for p in params_list], f32),
            frequency_penalties=row([p.frequency_penalty for p in params_list], f32),
            presence_penalties=row([p.presence_penalty for p in params_list], f32),
            repetition_penalties=row([p.repetition_penalty for p in params_list], f32),
            seeds=row(seeds, i64),
            steps=row([len(o) for o in output_ids_list], i64),
            min_new_tokens=row([p.min_new_tokens for p in params_list], i64),
            row_flags=flags,
        )
        if info.need_frequency_presence or info.need_repetition:
            info.output_counts = _rows_to_dense(output_ids_list, v, device, torch.int32, "output ids")
        if info.need_repetition:
            info.prompt_mask = _rows_to_dense(prompt_ids_list, v, device, torch.bool, "prompt ids")
        if info.need_min_new_tokens:
            stops = [_as_id_list(e) + list(p.stop_token_ids) for e, p in zip(eos_token_ids_list, params_list)]
            info.stop_token_mask = _rows_to_dense(stops, v, device, torch.bool, "eos / stop token ids")
        if info.need_logit_bias:
            biases = [p.logit_bias or {} for p in params_list]
            info.logit_bias = _rows_to_dense([list(b) for b in biases], v, device, torch.float32,
                                             "logit_bias token ids", values=[x for b in biases for x in b.values()])
        return info

    # -- flags (CPU-only reads) ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.temperatures.shape[0]

    @property
    def device(self) -> torch.device:
        return self.temperatures.device

    def _any(self, flag: _Flag) -> bool:
        return bool(self.row_flags[:, flag].any())

    @property
    def all_greedy(self) -> bool:
        return bool(self.row_flags[:, _Flag.GREEDY].all())

    @property
    def any_greedy(self) -> bool:
        return self._any(_Flag.GREEDY)

    @property
    def need_top_k(self) -> bool:
        return self._any(_Flag.TOP_K)

    @property
    def need_top_p(self) -> bool:
        return self._any(_Flag.TOP_P)

    @property
    def need_min_p(self) -> bool:
        return self._any(_Flag.MIN_P)

    @property
    def need_filtering(self) -> bool:
        return self.need_top_k or self.need_top_p or self.need_min_p

    @property
    def need_frequency_presence(self) -> bool:
        return self._any(_Flag.FREQ_PRES)

    @property
    def need_repetition(self) -> bool:
        return self._any(_Flag.REPETITION)

    @property
    def need_min_new_tokens(self) -> bool:
        return self._any(_Flag.MIN_NEW_TOKENS)

    @property
    def need_logit_bias(self) -> bool:
        return self._any(_Flag.LOGIT_BIAS)

    @property
    def need_penalties(self) -> bool:
        return self.need_frequency_presence or self.need_repetition or self.need_min_new_tokens

    def greedy_mask(self) -> torch.Tensor:
        """[B] bool on the device: rows that take the argmax (same rule as ``SamplingParams.is_greedy``)."""
        return (self.temperatures < GREEDY_TEMPERATURE_EPS) | (self.top_ks == 1)

    # -- evolution of a running batch ------------------------------------------------------------------------

    def update(self, new_token_ids: torch.Tensor) -> None:
        """Record the tokens just sampled (one per row): bump step counters and penalty counts, on the device."""
        if new_token_ids.shape != (len(self),):
            raise ValueError(f"expected {len(self)} new token ids, got shape {tuple(new_token_ids.shape)}")
        self.steps += 1
        if self.output_counts is not None:
            rows = torch.arange(len(self), device=self.device)
            ones = torch.ones(len(self), dtype=self.output_counts.dtype, device=self.device)
            # Each row appears once, so plain indexing would do; accumulate=True states the intent.
            self.output_counts.index_put_((rows, new_token_ids.to(self.device, torch.int64)), ones, accumulate=True)

    def filter(self, keep_indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the rows ``keep_indices`` (in that order), in place.

        Pass a Python list or a CPU tensor: a device tensor must be copied to the CPU for ``row_flags``, which waits
        for the device.
        """
        keep_cpu = torch.as_tensor(keep_indices, dtype=torch.int64).cpu()
        keep = to_device(keep_cpu, self.device)
        for name in _ROW_FIELDS + _STATE_FIELDS:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[keep])
        self.row_flags = self.row_flags[keep_cpu]
        self._drop_unneeded_state()

    def _drop_unneeded_state(self) -> None:
        """Free [B, V] state that no remaining row needs (keeps memory proportional to what is used)."""
        if not (self.need_frequency_presence or self.need_repetition):
            self.output_counts = None
        if not self.need_repetition:
            self.prompt_mask = None
        if not self.need_min_new_tokens:
            self.stop_token_mask = None
        if not self.need_logit_bias:
            self.logit_bias = None


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU tensor to ``device`` without waiting for the GPU.

    A host-to-device copy from ordinary (pageable) memory waits until the GPU has finished everything queued
    before it; under overlap scheduling (chapter 06) that is the whole step in flight. From pinned memory the copy
    is queued like a kernel and the CPU moves on (PyTorch's pinned-memory cache keeps the buffer alive until
    the copy has run)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _as_id_list(ids: Sequence[int] | int | None) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, int):
        return [ids]
    return list(ids)


def _rows_to_dense(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device, dtype: torch.dtype, what: str,
    values: Sequence[float] | None = None,
) -> torch.Tensor:
    """Ragged lists of token ids -> [B, V]: counts for integer dtypes, membership for bool, or each id's entry
    of ``values`` (flattened like the ids) when given.

    One scatter for the whole batch: flatten the ids, and repeat each row index once per id.
    """
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    cols = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= vocab_size):
        raise ValueError(f"{what} must lie in [0, {vocab_size}), got {int(cols.min())}..{int(cols.max())}")
    row_idx = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    out = torch.zeros(len(rows), vocab_size, dtype=dtype, device=device)
    if values is None:
        vals = torch.ones(cols.numel(), dtype=dtype, device=device)
    else:
        vals = torch.tensor(list(values), dtype=dtype).to(device)
    out.index_put_((row_idx.to(device), cols.to(device)), vals, accumulate=dtype != torch.bool)
    return out


#: The largest penalised logit. A repetition penalty r near 0 divides a positive logit by almost
#: nothing; the clamp keeps the result finite even after the smallest sampled temperature divides it again.
PENALISED_LOGIT_LIMIT = torch.finfo(torch.float32).max * GREEDY_TEMPERATURE_EPS / 2

# ----------------------------------------------------------------------------------------------------------------
# The three stages.
# ----------------------------------------------------------------------------------------------------------------


def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Return float32 logits [B, V] with repetition, frequency/presence penalties and min_new_tokens masking
    applied, in this order (the module docstring has the conventions and where they come from):

    1. **Repetition** (only if ``info.need_repetition``): every id that occurs in the prompt
       (``info.prompt_mask``, [B, V] bool) *or* in the output so far (``info.output_counts > 0``) has its logit
       divided by the row's ``repetition_penalties`` r when it is positive, and multiplied by r when it is not:
       both push it down for r > 1. r is kept above float32's smallest normal number and the results are
       capped at ``PENALISED_LOGIT_LIMIT``, so that a tiny r makes neither a +inf nor a NaN.
    2. **Frequency and presence** (only if ``info.need_frequency_presence``): with ``count`` the number of times
       the id was *generated* (``info.output_counts``, [B, V] int; the prompt does not count),
       ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
    3. **min_new_tokens** (only if ``info.need_min_new_tokens``): in a row that has generated fewer than its
       ``min_new_tokens`` tokens (``info.steps`` counts them), the ids of ``info.stop_token_mask`` (its EOS and stop
       token ids) get ``-inf`` -- unless that leaves the row no finite logit (a grammar already masked every other
       id): then the row is left as it was.

    Per-row knobs are [B] tensors (``info.repetition_penalties`` ...); the [B, V] state is None when no row needs
    it, which the ``need_*`` flags tell. Whole-batch tensor ops only: no Python loop over rows. Rows whose knobs
    are off must come out bit-identical: dividing by 1, subtracting 0 * count and masking nothing are exact.
    """
    # BEGIN TASK 2.2: penalties
    logits = logits.float()
    if info.need_repetition:
        assert info.prompt_mask is not None and info.output_counts is not None
        seen = info.prompt_mask | (info.output_counts > 0)
        # An r below ~1e-45 rounds to 0 in float32, and a grammar's -inf times 0 is NaN: keep r positive.
        rep = info.repetition_penalties[:, None].clamp_min(torch.finfo(torch.float32).tiny)
        # Dividing a positive logit and multiplying a negative one both push it *down* for r > 1.
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        # A tiny r overflows the division to +inf, and two +inf logits make the softmax inf - inf = NaN.
        # Capping them keeps them finite (a grammar's -inf stays -inf): the seen positive ids tie at the cap.
        penalised = penalised.clamp_max(PENALISED_LOGIT_LIMIT)
        logits = torch.where(seen, penalised, logits)
    if info.need_frequency_presence:
        assert info.output_counts is not None
        counts = info.output_counts.float()
        logits = (
            logits
            - info.frequency_penalties[:, None] * counts
            - info.presence_penalties[:, None] * (counts > 0).float()
        )
    if info.need_min_new_tokens:
        assert info.stop_token_mask is not None
        too_early = info.steps < info.min_new_tokens  # [B]; evaluated on the device, no sync
        banned = logits.masked_fill(info.stop_token_mask & too_early[:, None], float("-inf"))
        # A grammar that has nothing left to add allows only EOS: banning it too would leave no token at all,
        # and a row of -inf is a NaN softmax. There the grammar wins and the row keeps its stop ids.
        nothing_left = torch.isneginf(banned).all(dim=-1, keepdim=True)
        logits = torch.where(nothing_left, logits, banned)
    return logits
    # END TASK 2.2


def top_k_top_p_min_p_filter(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """Zero out the tokens each row's top-k, top-p and min-p exclude, and renormalise each row to sum to 1.

    Applied in sequence, like HF's logits warpers and vLLM:

    1. top-k keeps the k most probable tokens;
    2. top-p keeps the smallest prefix (by descending probability) of what top-k left whose renormalised mass
       reaches ``top_p`` -- i.e. token at rank r survives iff the mass strictly above it is < top_p;
    3. min-p drops tokens whose probability is below ``min_p`` times the largest one (a ratio, so it does not
       matter whether the probabilities were renormalised first).

    ``probs`` is [B, V] (rows sum to 1); ``top_ks`` [B] int64 (``V`` when off), ``top_ps`` and ``min_ps`` [B]
    float32 (1 and 0 when off). The most probable token always survives, so no row is left empty. Top-k keeps
    exactly k tokens even when several share the k-th probability (which of the tied ones is free:
    ``torch.sort``'s order will do). Whole-batch tensor ops only (sort, cumsum, scatter), no Python loop over rows.
    """
    # BEGIN TASK 2.3: top-k / top-p / min-p filtering
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    keep = ranks[None, :] < top_ks[:, None]  # a prefix of the sorted order

    kept = sorted_probs.masked_fill(~keep, 0.0)
    cumulative = kept.cumsum(dim=-1)
    mass_above = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    top_k_mass = cumulative[:, -1:]
    # Comparing against top_p * (mass kept by top-k) renormalises without a division. Rows with top_p == 1 keep
    # everything explicitly: float32 rounding could otherwise make the tail's mass_above reach the total.
    in_nucleus = (mass_above < top_ps[:, None] * top_k_mass) | (top_ps[:, None] >= 1.0)
    keep &= in_nucleus

    keep &= sorted_probs >= min_ps[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True  # already implied (k >= 1, no mass above the top, min_p <= 1); stated for the reader

    mask = torch.zeros_like(keep).scatter_(1, order, keep)  # back from rank order to vocabulary order
    filtered = probs.masked_fill(~mask, 0.0)
    return filtered / filtered.sum(dim=-1, keepdim=True)
    # END TASK 2.3


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` float32 numbers in (0, 1), where entry (i, v) is a fixed function of ``(seeds[i], steps[i], v)``.

    This is a counter-based generator: instead of a stateful RNG whose output depends on how many numbers were
    drawn before (and therefore on batch size and order), each number is a hash of its coordinates.

    * Per row, fold the 64-bit seed and the step into two 32-bit keys (cheap: [B] work).
    * Per element, hash the vocab id under those keys. Why two keyed rounds? With a single ``hash(v ^ key)``, two
      rows whose keys differ only in bits below ``V`` (a chance of about ``V / 2**32`` per pair of rows, so it does
      happen over a long generation) would get the very same numbers, merely permuted -- and their draws would be
      correlated. The second round, under an independent key, scrambles that coincidence away.
    * Map the 32-bit hash h to ``(h + 0.5) / 2**32``: never exactly 0. The conversion to float32 keeps full
      relative precision near 0, which is where the winners of the race below live; near 1 we clamp so that
      ``1 - u`` never rounds to 0.

    ``seeds`` and ``steps`` are [B] int64 (seeds may be negative: use all 64 bits, so that seeds which differ only
    in their high half are different seeds). Keep every intermediate in [0, 2**32) as the comment above
    :func:`hash32` explains (mask with ``_MASK32``); :func:`hash32` is the mixer, ``_SALT_SEED`` and
    ``_SALT_KEY2`` are constants to separate its uses. The result must not depend on anything but
    ``(seeds[i], steps[i], v)``: not on the row's index, the other rows, or the device.
    """
    # BEGIN TASK 2.4: seeded, batch-independent noise
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32  # arithmetic shift, then mask: the top 32 bits of the two's complement
    key = hash32(seed_hi ^ _SALT_SEED)
    key = hash32(key ^ seed_lo)
    key1 = hash32(key ^ (steps & _MASK32))  # [B]
    key2 = hash32(key1 ^ _SALT_KEY2)  # [B]

    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    h = hash32(vocab[None, :] ^ key1[:, None])
    h = hash32(h ^ key2[:, None])  # [B, V] in [0, 2**32)

    u = (h.to(torch.float32) + 0.5) * (2.0**-32)
    return u.clamp_(max=1.0 - 2.0**-24)
    # END TASK 2.4


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from ``probs`` (rows need not be normalised) with the exponential race.

    With independent ``E_v ~ Exp(1)``, ``E_v / p_v ~ Exp(rate p_v)``, and the smallest of independent exponentials
    is the one with rate ``p_v`` with probability ``p_v / sum(p)``. So ``argmax(p / E) = argmin(E / p)`` is an exact
    draw from ``p`` -- one elementwise pass and an argmax, no cumulative sum, no sort, and zero-probability tokens
    can never win. (This is the Gumbel-max trick written without logarithms of ``p``.)
    """
    u = seeded_uniform(seeds, steps, probs.shape[-1])
    exponential = -torch.log1p(-u)  # inverse CDF of Exp(1); log1p keeps precision for small u
    return (probs / exponential).argmax(dim=-1)


def temperature_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                       steps: torch.Tensor) -> torch.Tensor:
    """Softmax at each row's temperature, then the seeded draw: the whole path of an unfiltered batch."""
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    return sample_from_probs(probs, seeds, steps)


def penalised_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """float32 logits after the logit bias and the penalties: what a greedy row takes the argmax of, and what a
    sampled row's temperature divides. Named on its own so that a caller outside the sampler (speculative
    decoding's acceptance rule, chapter 13) processes logits exactly as a plain step does."""
    logits = logits.float()
    if info.logit_bias is not None:
        logits = logits + info.logit_bias
    if info.need_penalties:
        logits = apply_penalties(logits, info)
    return logits


def sampling_temperatures(info: SamplingBatchInfo) -> torch.Tensor:
    """[B] float32: each row's temperature, with 1 for greedy rows, which the argmax answers: the division by
    their (near-zero) temperature would not stay finite."""
    return torch.where(info.greedy_mask(), torch.ones_like(info.temperatures), info.temperatures)


def sampling_probs(logits: torch.Tensor, info: SamplingBatchInfo,
                   temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] float32: the distribution a sampled row draws its token from, given its :func:`penalised_logits`:
    ``softmax(logits / T)``, then top-k / top-p / min-p and renormalisation where some row asks for them."""
    if temperatures is None:
        temperatures = sampling_temperatures(info)
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    if info.need_filtering:
        probs = top_k_top_p_min_p_filter(probs, info.top_ks, info.top_ps, info.min_ps)
    return probs


@dataclass
class StepLogprobs:
    """Per row of a step: the log probability of the token sampled there, and the ``k`` most likely tokens with
    theirs (``k`` = the most any row of the step asked for). Device tensors until copied to the host."""

    chosen: torch.Tensor  # [B] float32
    top_values: torch.Tensor  # [B, k] float32, best first
    top_ids: torch.Tensor  # [B, k] int64

    def to(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> StepLogprobs:
        return StepLogprobs(fn(self.chosen), fn(self.top_values), fn(self.top_ids))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int,
                   temperatures: torch.Tensor | None = None) -> StepLogprobs:
    """``log_softmax(logits / T)`` at ``targets`` (one per row) and its top ``k``. ``-inf`` (a banned token) is
    clamped to float32's lowest value, as SGLang does, so that the numbers survive JSON."""
    if temperatures is not None:
        logits = logits / temperatures[:, None]
    lp = torch.log_softmax(logits.float(), dim=-1).clamp_(min=torch.finfo(torch.float32).min)
    chosen = lp.gather(1, targets.to(torch.int64)[:, None]).squeeze(1)
    top_values, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].to(torch.int64))
    return StepLogprobs(chosen, top_values, top_ids)


class Sampler:
    """Turns a batch of logits into one token id per row; stateless (all state lives in ``SamplingBatchInfo``).

    Between steps the per-request step counters (the noise stream) and penalty counts must move on: a loop that
    calls the sampler directly does it with ``info.update(tokens)`` (chapter 02); the engine's model runner
    rebuilds or advances the state itself (``SamplingState.info``), because under overlap it schedules the
    next step before it has seen this step's tokens.

    ``fuse_on_cuda`` (default on) runs the random draw as one Triton kernel (:mod:`.fused_draw`) on a GPU;
    on the CPU, and with it off, the plain eager functions of this file run, which is what the tests read.
    """

    def __init__(self, fuse_on_cuda: bool = True) -> None:
        self.fuse_on_cuda = fuse_on_cuda

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        return self.sample(logits, info)[0]

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo,
               top_logprobs: int = -1) -> tuple[torch.Tensor, StepLogprobs | None]:
        """One token per row, and with ``top_logprobs >= 0`` also their log probabilities and that many
        alternatives (see the module docstring for which distribution they describe)."""
        if logits.dim() != 2 or logits.shape[0] != len(info) or logits.shape[1] != info.vocab_size:
            raise ValueError(f"logits must be [{len(info)}, {info.vocab_size}], got {tuple(logits.shape)}")
        fuse = self.fuse_on_cuda and fused_draw.available(logits)
        # Plain temperature sampling reads the logits once, in the fused kernel, which converts bf16 / fp16 to
        # float32 itself (exactly); every other path needs a float32 copy first.
        one_pass = (fuse and info.logit_bias is None and not info.need_penalties and not info.all_greedy
                    and not info.need_filtering and top_logprobs < 0)
        if not one_pass:  # (the one-pass case has neither a logit bias nor penalties to apply)
            logits = penalised_logits(logits, info)
        if info.all_greedy:
            tokens = logits.argmax(dim=-1)  # ties go to the lowest id, as in every torch argmax
            return tokens, token_logprobs(logits, tokens, top_logprobs) if top_logprobs >= 0 else None

        greedy = info.greedy_mask()
        temperatures = sampling_temperatures(info)
        if fuse and not info.need_filtering:  # plain temperature sampling: one pass over the logits
            tokens = fused_draw.temperature_sample(logits, temperatures, info.seeds, info.steps)
        else:
            probs = sampling_probs(logits, info, temperatures)
            draw = fused_draw.sample_from_probs if fuse else sample_from_probs
            tokens = draw(probs, info.seeds, info.steps)
        if info.any_greedy:  # argmax in bf16 picks the same id as in float32: the conversion is exact
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        if top_logprobs < 0:
            return tokens, None
        return tokens, token_logprobs(logits, tokens, top_logprobs, temperatures)
