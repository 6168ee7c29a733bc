"""pdserve: LLM serving with prefill/decode disaggregation over a paged, prefix-cached KV cache."""

__version__ = "0.1.0"
