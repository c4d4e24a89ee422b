"""Pallas GPU kernels, one kernel per file, each with its pure-jnp reference."""
