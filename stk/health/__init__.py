"""stk-health: GPU node health checks (NVML readings, rules, reports), importable without torch."""
