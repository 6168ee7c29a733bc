"""The router: the OpenAI API, routing policies and the PD client that drives instances."""
