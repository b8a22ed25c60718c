"""Sampling, once per step on rank 0: request params -> the batched sampler's draws (grammar masks, rejection sampling of draft tokens). Below core/, step/, worker/, text/."""
