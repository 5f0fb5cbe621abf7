"""Building blocks shared by every model: tensor-parallel linear layers, embeddings, norm, RoPE, activation."""
