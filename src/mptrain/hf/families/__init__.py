"""One module per Hugging Face model family, each listing its `mptrain.hf.Family` objects in ``FAMILIES``."""
