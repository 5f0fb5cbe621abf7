"""The benchmark workloads, generated exactly as the published numbers were (chapter 11).

A throughput number means nothing without its workload, so the workloads are code, seeded, and tested:

* :func:`canonical_workload` is the offline workload that nano-vllm and Mini-SGLang publish: 256 requests of
  random token ids with random prompt and output lengths. Its random numbers are drawn in a fixed order (every
  prompt first, then every ``max_tokens``), so ``random.seed(0)`` reproduces the same 133,966 output tokens
  everywhere.
* :func:`random_workload` is SGLang's *random* dataset, which ``bench serving`` sends to a server (chapter 10).
* :func:`shared_prefix_workload` is SGLang's *generated-shared-prefix* workload: ``G`` groups of ``P`` requests,
  each prompt a group-wide system prompt followed by a private question. It exists to measure prefix sharing
  (chapter 04): an engine with a radix cache computes each system prompt once per group instead of once per
  request.

Each returns a :class:`Workload`: token-id prompts plus one sampling-parameter dict per request, ready for
``LLM.generate``. This module imports nothing heavier than :mod:`random`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

CANONICAL_OUTPUT_TOKENS = 133_966  # what the canonical workload totals; tests/test_bench.py checks it
TOKEN_ID_HIGH = 10_000  # prompts draw ids from [0, 10000] inclusive, as random.randint does


@dataclass
class Workload:
    """A list of requests for one ``generate`` call.

    ``prompts[i]`` is a list of token ids and ``sampling_params[i]`` the keyword arguments of its
    :class:`~minisgl_ref.sampling.params.SamplingParams`. ``spec`` records how the workload was generated, so
    that a results file can say exactly what was measured."""

    name: str
    prompts: list[list[int]]
    sampling_params: list[dict[str, Any]]
    spec: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        """The tokens the workload asks for. With ``ignore_eos`` every request produces exactly this many."""
        return sum(p["max_new_tokens"] for p in self.sampling_params)

    @property
    def max_vocab_id(self) -> int:
        """The largest token id in any prompt: the model's vocabulary must be larger than this."""
        return max(max(p) for p in self.prompts)

    def summary(self) -> dict[str, Any]:
        """The workload's description plus its totals, for the results file."""
        return {"name": self.name, **self.spec, "requests": self.num_requests,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens}


def _sampling(max_new_tokens: int, temperature: float) -> dict[str, Any]:
    """Benchmark sampling: a fixed number of tokens per request (``ignore_eos``), sampled, not greedy."""
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True}


def canonical_workload(
    num_prompts: int = 256,
    *,
    input_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    temperature: float = 0.6,
    seed: int = 0,
) -> Workload:
    """The nano-vllm / Mini-SGLang offline workload (chapter 11).

    With the defaults this is *the* canonical workload: ``random.seed(0)``; 256 prompts of
    ``randint(100, 1024)`` token ids each drawn by ``randint(0, 10000)``; then 256 output lengths
    ``randint(100, 1024)``; temperature 0.6 and ``ignore_eos``. The order of the draws is part of the
    definition: drawing each request's output length right after its prompt would give a different workload.

    Smaller ``num_prompts`` and length ranges give the CPU-sized ``--quick`` variant of the same recipe.
    It uses the global :mod:`random` generator, exactly as the published scripts do, and leaves it seeded.

    In order: ``random.seed(seed)``; for each of the ``num_prompts`` prompts, its length
    ``random.randint(*input_len)`` and then that many ids ``random.randint(0, TOKEN_ID_HIGH)`` (both bounds
    inclusive); then, for each request, ``random.randint(*output_len)``. Each request's sampling parameters are
    ``_sampling(max_new_tokens, temperature)``, and ``spec`` records ``num_prompts``, ``input_len`` and
    ``output_len`` (as lists), ``temperature``, ``ignore_eos`` (True) and ``seed``."""
    # BEGIN TASK 11.1: the canonical offline workload
    random.seed(seed)
    prompts = [
        [random.randint(0, TOKEN_ID_HIGH) for _ in range(random.randint(*input_len))] for _ in range(num_prompts)
    ]
    max_tokens = [random.randint(*output_len) for _ in range(num_prompts)]
    spec = {"num_prompts": num_prompts, "input_len": list(input_len), "output_len": list(output_len),
            "temperature": temperature, "ignore_eos": True, "seed": seed}
    return Workload("canonical", prompts, [_sampling(m, temperature) for m in max_tokens], spec)
    # END TASK 11.1


def random_workload(
    num_prompts: int,
    *,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    temperature: float,
    seed: int,
) -> Workload:
    """SGLang's *random* dataset as ``bench serving`` sends it: ``num_prompts`` prompts of random token ids in
    ``[0, TOKEN_ID_HIGH]``, each of a length drawn from ``input_len`` (inclusive bounds), then every request's
    ``max_new_tokens`` drawn from ``output_len``. A private :class:`random.Random` seeded with ``seed`` draws
    them, so generating it disturbs nothing else, and the same seed always sends the same requests."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, TOKEN_ID_HIGH) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]
    max_tokens = [rng.randint(*output_len) for _ in range(num_prompts)]
    spec = {"num_prompts": num_prompts, "input_len": list(input_len), "output_len": list(output_len),
            "temperature": temperature, "ignore_eos": True, "seed": seed}
    return Workload("random", prompts, [_sampling(m, temperature) for m in max_tokens], spec)


def shared_prefix_workload(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    *,
    temperature: float = 0.6,
    seed: int = 0,
) -> Workload:
    """SGLang's generated-shared-prefix workload (``bench_serving --dataset-name generated-shared-prefix``).

    ``num_groups`` system prompts of ``system_len`` random tokens, then ``num_groups * prompts_per_group``
    questions of ``question_len`` random tokens; request ``(g, p)`` is system prompt ``g`` followed by question
    ``g * prompts_per_group + p`` and asks for exactly ``output_len`` tokens. As in SGLang the requests are
    shuffled, so that the members of a group arrive spread out rather than back to back. The defaults are
    SGLang's (``--gsp-num-groups 64 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048
    --gsp-question-len 128 --gsp-output-len 256``); SGLang draws random *text*, we draw token ids directly.

    A private :class:`random.Random` is used, so generating this workload does not disturb anything else."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randint(0, TOKEN_ID_HIGH) for _ in range(n)]

    systems = [tokens(system_len) for _ in range(num_groups)]
    questions = [tokens(question_len) for _ in range(num_groups * prompts_per_group)]
    prompts = [systems[g] + questions[g * prompts_per_group + p]
               for g in range(num_groups) for p in range(prompts_per_group)]
    rng.shuffle(prompts)
    spec = {"num_groups": num_groups, "prompts_per_group": prompts_per_group, "system_len": system_len,
            "question_len": question_len, "output_len": output_len, "temperature": temperature,
            "ignore_eos": True, "seed": seed}
    params = [_sampling(output_len, temperature) for _ in prompts]
    return Workload("shared-prefix", prompts, params, spec)


def warmup_workload(num_prompts: int = 4, prompt_len: int = 32, output_len: int = 8) -> Workload:
    """A few short requests to run before timing on a GPU: they pay for CUDA context creation, kernel loading
    and the caching allocator's first allocations, which are not part of the engine's steady-state speed."""
    rng = random.Random(1234)
    prompts = [[rng.randint(0, TOKEN_ID_HIGH) for _ in range(prompt_len)] for _ in range(num_prompts)]
    return Workload("warmup", prompts, [_sampling(output_len, 0.6) for _ in prompts],
                    {"num_prompts": num_prompts, "prompt_len": prompt_len, "output_len": output_len})
