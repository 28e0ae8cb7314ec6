"""vLLM's gRPC worker protocol (`vllm.grpc.engine.VllmEngine`), served for gateways such as smg beside tandem.v1:
the servicer (servicer.py), its proto edge (convert.py), the engines' KV events and load as a feed
(kv_event_feed.py) and the tokenizer as a ZIP (tokenizer_archive.py). docs/gateway.md tells the whole path."""
