"""Real text: tokenizers (bytes, or a Hugging Face `tokenizer.json`) and the preparation of
raw files into a flat token array with a sidecar (`python -m engine.prepare`)."""
