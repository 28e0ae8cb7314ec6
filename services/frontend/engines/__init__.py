"""The frontend's engines: the EngineClient interface AsyncLLM drives (client.py) over gRPC (grpc_client.py, one
connection.py per engine, found by discovery.py, chosen by router.py) or in this process (in_process.py)."""
