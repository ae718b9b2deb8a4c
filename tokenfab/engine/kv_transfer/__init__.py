"""Moving KV blocks beyond one device's cache: the connector interface (``connector.py``), copying blocks out
of and into a runner's cache tensors (``block_io.py``), and the host-memory + local-disk tier that evicted
prefix blocks go to (``tier.py``, ``offload.py``). Prefill/decode transfer implements the same interface."""
