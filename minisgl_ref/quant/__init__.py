"""Chapter 15: quantization (FP8 weights and an FP8 KV cache)."""
