"""Ray Serve application: engine replicas (target + DSpark speculator), load-aware router, OpenAI HTTP API."""
