"""Eviction: the policies that choose which cells to keep, and the manager that holds the cache to its budget."""
