"""Measurements that are not part of the engine: run from the repository root as ``python -m benchmarks.<name>``.

* :mod:`benchmarks.tp`: tensor parallelism checked and measured, and the collectives counted (chapter 09);
* :mod:`benchmarks.kernels`: attention kernels alone against the memory roofline (chapter 07).

``python -m minisgl_ref bench offline`` and ``bench serving`` stay in the package (they work from an installed
package); these need the engine's source tree and, mostly, a GPU.
"""
