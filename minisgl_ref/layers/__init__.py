"""Building blocks shared by every model: tensor-parallel linear layers, embeddings, norm, RoPE, activation, and the
kernel table through which they call their small per-token ops."""
