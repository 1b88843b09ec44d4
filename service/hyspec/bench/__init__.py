"""``hyspec bench``: hyspec side by side with llama-server from the same pinned llama.cpp.

models     the benchmark's GGUFs, written once into the cache
scenarios  what runs, as data (the full set and --quick)
records    what a run reports
worker     the in-process hyspec engine in a child process
peer       llama-server on loopback
remote     ``hyspec serve`` and a gRPC client
runner     each scenario: processes, warm-up, alternating pairs, tie-aware checks
report     medians, ratios, markdown tables, JSON
run        the command itself
"""
