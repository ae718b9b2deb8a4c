"""tokenfab: a token factory. LLM inference whose hot paths are Triton kernels."""

from tokenfab.engine.requests.outputs import CompletionOutput, Logprob, RequestOutput
from tokenfab.engine.requests.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    # LLM pulls in torch models and the loader; import it lazily so `import tokenfab` stays light.
    if name == "LLM":
        from tokenfab.engine.llm import LLM

        return LLM
    raise AttributeError(name)
