"""vLLM's offline API over an in-process EngineCore: `LLM` (batches of prompts or chats run to completion),
`LLMEngine` (step by step), and the offline request that detokenizes each one's outputs. Import them from
`engine_core` itself (`from engine_core import LLM`).
"""
