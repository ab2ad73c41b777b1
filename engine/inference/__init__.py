"""The inference pool: vLLM servers, live weight reload, and an async client over them."""
