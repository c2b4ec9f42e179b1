"""Benchmarks (not tests): one command each, machine-readable results plus a Markdown table.

python -m loadtests.benchmarks.batching --out loadtests/benchmarks/results
"""
