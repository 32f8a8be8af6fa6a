"""Helpers shared by test modules, so that no test module imports another."""
