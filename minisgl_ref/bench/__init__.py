"""Benchmarks (chapter 11): the workloads every number in this book is measured on, and the tools that measure.

* :mod:`~minisgl_ref.bench.workloads`: the canonical offline workload and SGLang's generated-shared-prefix
  workload, seeded and reproducible;
* :mod:`~minisgl_ref.bench.offline`: ``python -m minisgl_ref bench offline``, the stage ladder and the roofline;
* :mod:`~minisgl_ref.bench.provenance`: the hardware, software and command line recorded with every result;
* :mod:`~minisgl_ref.bench.step_trace`: the per-step trace (``--step-log``), an engine extension, and its summary.
"""

from minisgl_ref.bench.workloads import Workload, canonical_workload, shared_prefix_workload

__all__ = ["Workload", "canonical_workload", "shared_prefix_workload"]
