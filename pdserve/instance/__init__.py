"""The instance runtime every prefill, decode and mixed instance is built on (services/*)."""
