"""primeflow: flows."""
