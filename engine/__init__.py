"""primeflow: engine."""
