"""Ray actors that wrap heavy engines (vLLM generator / hidden-state extractor, Mooncake master)."""
