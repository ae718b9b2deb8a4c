"""The engine-core process, its IPC, and the clients that talk to it: the in-process
AsyncEngine, the core-process client and the data-parallel client."""
