"""kvstrata inside inference engines: a tiny offline model, transformers and vLLM."""
