"""The llmopt engine: paged KV cache, continuous batching, prefix caching (nano-vllm layout)."""
