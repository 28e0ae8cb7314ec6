"""Tandem's clients: client.py (TandemClient) and async_client.py (AsyncTandemClient) over the
generated tandem.v1 stubs, the `tandem` CLI (cli/), the benchmark harness (bench/) and a Node
client (node/)."""
