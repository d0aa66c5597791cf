"""The engine (layer 2): model loading, KV cache, attention, sampling, the sequence table and the model runner."""
