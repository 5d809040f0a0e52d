"""jaxpage: PagedAttention LLM serving in JAX."""
from jaxpage.engine.llm_engine import EngineArgs, LLMEngine
from jaxpage.entrypoints.llm import LLM
from jaxpage.outputs import CompletionOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from jaxpage.pooling_params import PoolingParams
from jaxpage.sampling_params import SamplingParams
from jaxpage.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "PoolingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "PoolingRequestOutput", "EmbeddingRequestOutput"]
