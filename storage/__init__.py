"""primeflow: storage."""
