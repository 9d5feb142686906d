"""The model families the engine serves (Llama, Qwen2, Qwen3, Mistral; a BERT encoder for embeddings), their
weights (safetensors, GGUF) and the native kernels."""
