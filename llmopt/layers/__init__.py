"""Building blocks of our llama-family forward: norms, rotary embeddings, paged attention, sampling."""
