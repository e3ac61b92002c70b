"""prism-serve."""
