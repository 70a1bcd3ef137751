"""The benchmark report: Markdown tables and plots from a harness results file."""
