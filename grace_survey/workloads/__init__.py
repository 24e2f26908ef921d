"""Survey workloads: the contract, the registry and the built-ins, their data, models and the text workload."""
