"""Layer 7, engine: EngineArgs and the EngineConfig built from them, LLMEngine's step loop, the output processor
and detokenizer, the asyncio engine and data-parallel replicas."""
