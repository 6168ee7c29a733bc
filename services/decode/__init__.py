"""The decode instance: reservations, KV reception, token generation and streaming."""
