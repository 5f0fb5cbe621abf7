"""Sampling parameters and the batched sampler (chapter 02, sampling half).

``SamplingParams`` is what one request asks for; ``SamplingBatchInfo`` packs a batch of them into tensors;
``Sampler`` turns a batch of logits into one token per request.
"""

from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.sampling.sampler import Sampler, SamplingBatchInfo

__all__ = ["SamplingParams", "SamplingBatchInfo", "Sampler"]
