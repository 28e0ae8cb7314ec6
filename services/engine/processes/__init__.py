"""tandem-engine's two processes: the engine process steps the model on its main thread (engine_process.py) and
starts the server process, which serves gRPC (server_process.py); one socket pair joins them (socket_pair.py:
EngineEnd in the engine process, RemoteBusyLoop in the server process). The gRPC service drives a busy loop
through one interface (busy_loop_interface.py), in its own process or across the socket. Why two processes:
docs/cpu-tuning.md#two-processes-per-engine."""
