"""Parallel executors: the tensor-parallel executor and its workers, attention-DP lockstep, EPLB in the engine."""
