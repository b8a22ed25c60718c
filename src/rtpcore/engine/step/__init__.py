"""Once per step on rank 0: a core/ plan -> staged inputs -> the ranks' forward -> sample/'s draws -> each request's result, faults kept with their request. Above core/."""
