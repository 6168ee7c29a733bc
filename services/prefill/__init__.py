"""The prefill instance: computes prompts' KV and hands it to decode instances."""
