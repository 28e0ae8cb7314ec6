"""Scheduling: which requests run in the next step and where their KV cache lives. The scheduler (continuous
batching under a per-step token budget) over its waiting queues, the KV cache manager's per-request block tables
over the block pool (prefix caching), and what the scheduler reports: its stats and the pool's KV events.
"""
