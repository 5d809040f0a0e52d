"""Layer 3, models: shared NNX layers, one module per architecture, the registry that picks it, and loading
(GGUF or a Hugging Face directory, converted and cached with orbax).

Adding an architecture: a module beside llama.py (see registry.py for what it gives) and a line in the registry.
"""
from jaxpage.models.batch import TokenBatch
from jaxpage.models.causal_lm import (
    CausalLM,
    abstract_params,
    begin_layers,
    cast_weights,
    compute_logits,
    compute_raw_logits,
    concat_aux,
    final_norm,
    forward_hidden,
    forward_hidden_aux,
    layer_linears,
    model_graph,
    partition_specs,
    run_layer,
    run_layers,
    stack_layers,
    top_weights,
    unstack_layers,
)
from jaxpage.models.registry import SUPPORTED_MODEL_TYPES, architecture, config_from_hf
from jaxpage.models.weights import hf_state_from_gguf, params_from_hf_state, quantize_params

__all__ = ["TokenBatch", "CausalLM", "abstract_params", "begin_layers", "cast_weights", "compute_logits",
           "compute_raw_logits", "concat_aux", "final_norm", "forward_hidden", "forward_hidden_aux", "layer_linears",
           "model_graph", "partition_specs", "run_layer", "run_layers", "stack_layers", "top_weights",
           "unstack_layers", "SUPPORTED_MODEL_TYPES", "architecture", "config_from_hf", "hf_state_from_gguf",
           "params_from_hf_state", "quantize_params"]
