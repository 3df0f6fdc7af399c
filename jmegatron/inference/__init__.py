"""Text generation: the KV-cache generator and the plain reference sampler."""
