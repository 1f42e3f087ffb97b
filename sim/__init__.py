"""Stand-ins for GPU inference servers: OpenAI-compatible backends (a vLLM-like simulator comes next)."""
