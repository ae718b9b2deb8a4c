"""Speculative decoding: proposers and the lossless acceptance rule (the engine calls it; no HTTP here)."""
