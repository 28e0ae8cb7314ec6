"""`tandem bench`: load generators, metrics, report and plot for benchmarking a Tandem frontend.

prompts.py     synthetic prompts (token- or word-length controlled) and JSONL prompt files
backends.py    what a request is sent to: Tandem over gRPC, the in-process LLMEngine, a llama.cpp server
loadgen.py     closed loop (N concurrent) and open loop (seeded Poisson arrivals)
metrics.py     per-request records -> TTFT, ITL, TPOT, e2e percentiles, throughput, errors by code
report.py      the table and the JSON;  plot.py  the PNG of a sweep
side_by_side.py  Tandem vs its peers on the same prompts, with ratios;  command.py  the CLI
"""
