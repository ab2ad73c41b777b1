"""primeflow: tasks."""
