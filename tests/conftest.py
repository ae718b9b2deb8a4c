import os

# Tests run the engine on CPU; keep torch from oversubscribing the 2 cores of CI machines.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
