"""Agent workloads, the benchmark harness and its report."""
