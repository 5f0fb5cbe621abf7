"""Speculative decoding (chapter 13): propose several tokens cheaply, verify them in one forward pass of the
target model, keep the longest prefix the target agrees with.

A decode step of a small batch reads every weight of the model to produce one token per request: it is bound by
memory bandwidth, and the arithmetic units idle. Verifying k drafted tokens costs about the same read, so each
accepted draft token is nearly free. The package plugs into the core engine through its seams; the core never
imports it.
"""
