"""Mixture of experts (chapter 14): routers, the expert computation (a reference loop and a fused Triton kernel),
the MoE models (Qwen3-MoE, Mixtral) and expert parallelism."""
