"""`tandem-engine` (python -m services.engine): serve one EngineCore over gRPC.

    python -m services.engine --model ./my-llama --port 50061

Every EngineConfig field is a flag. The engine steps on the main thread, gRPC I/O runs on a
background thread (services/engine/processes/engine_process.py). SIGTERM / SIGINT drain gracefully: health goes
NOT_SERVING, new requests are held, requests in flight get --grace seconds to finish,
then the streams close (held requests end UNAVAILABLE) and the process exits 0. A taken --port
or --metrics-port ends it at once with one line and exit 1, before the model loads (services/ports.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

from engine_core.config import (
    DEFAULT_SPECULATIVE_MAX_BATCH,
    KV_CACHE_DTYPES,
    LORA_KERNELS,
    SPECULATIVE_METHODS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine_core.openmp_env import limit_openmp_spinning
from services.cpu_affinity import step_cpu_flag
from services.cpu_priority import CPU_PRIORITIES
from services.engine.busy_loop import DEFAULT_BURST_WINDOW_S
from services.engine.outbox import DEFAULT_MAX_PENDING_OUTPUTS
from services.ports import PortUnavailable, ensure_can_listen, explain_bind_failure
from services.security import flags as security_flags
from services.security.transport import ENGINE_LINK_MAX_MESSAGE_BYTES
from services.telemetry import flags as telemetry_flags
from services.telemetry.request_log import configure_logging
from services.telemetry.tracing import setup_tracing, shutdown_tracing

logger = logging.getLogger("tandem.engine")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default once: not where the help already says it, not for flags without one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    defaults = EngineConfig()
    model, cache, sched, device = defaults.model, defaults.cache, defaults.scheduler, defaults.device
    p = argparse.ArgumentParser(
        prog="tandem-engine", description="Serve an engine core (tandem.v1.EngineCoreService) over gRPC.",
        formatter_class=_HelpFormatter,
    )
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    server.add_argument("--port", type=int, default=50061, help="port to listen on (0 picks a free one)")
    server.add_argument("--stall-timeout", type=float, default=30.0,
                        help="seconds without engine progress, while there is work, before health says NOT_SERVING")
    server.add_argument("--grace", type=float, default=5.0, help="seconds requests in flight get to finish on shutdown")
    server.add_argument("--max-pending-outputs", type=int, default=DEFAULT_MAX_PENDING_OUTPUTS,
                        help="output messages buffered per connection for a client that does not read; "
                             "beyond that the connection ends with RESOURCE_EXHAUSTED and its requests are aborted")
    server.add_argument("--burst-window-ms", type=float, default=1000 * DEFAULT_BURST_WINDOW_S,
                        help="the longest an idle engine waits for the rest of a burst after its first request, "
                             "taking requests that come within 2 ms of each other, so they start in one step "
                             "(0: step at once)")
    server.add_argument("--io-cpu-priority", default="normal", choices=CPU_PRIORITIES,
                        help="CPU priority of the gRPC server process beside the engine's (the model steps on the "
                             "engine process's main thread, gRPC is served by a child process): idle (SCHED_IDLE) "
                             "runs it only on a core the engine's OpenMP team leaves free, so its wake-ups do not "
                             "stall a step, but outputs then wait for a core and reach clients in clumps (measured: "
                             "tok/s within noise of normal, inter-token p50 0.5 ms instead of one step); low: nice "
                             "19; normal: as the process was started")
    server.add_argument("--step-cpu", default="auto", type=step_cpu_flag, metavar="{auto,none,N}",
                        help="the CPU the model steps on, the gRPC server process running on the others, so that "
                             "its wake-ups do not preempt the step: auto (the CPU the engine's main thread is on), "
                             "none (no pinning), or a CPU number of this process's set (measured on a 2-core Xeon: "
                             "1-stream tok/s over gRPC 0.92-0.93 of in-process with auto, 0.86-0.88 with none). "
                             "Several engines on one machine: give each its own CPU set (taskset, --cpuset-cpus)")
    server.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level")
    security_flags.add_server_flags(p, max_message_bytes=ENGINE_LINK_MAX_MESSAGE_BYTES)
    telemetry_flags.add_telemetry_arguments(p.add_argument_group("observability"))

    m = p.add_argument_group("model")
    m.add_argument("--model", default=model.model,
                   help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    m.add_argument("--dtype", default=model.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype; auto: bfloat16 on CUDA, "
                        "on CPU the faster of bf16/fp32 measured at load")
    m.add_argument("--quantization", default=model.quantization, choices=["auto", "int8", "int4", "none"],
                   help="CPU linear layers, the fastest kernel measured per batch size: none keeps float weights; "
                        "int8 quantizes on load (weight-only, or W8A8 with activations rounded to 8 bits; lossy); "
                        "int4 quantizes to 4-bit groups of 32 (GGUF Q4_0/Q4_1 style); "
                        "auto: the kernels within each layer's accuracy budget (float, int4 where exact as in a "
                        "Q4_0/Q4_1 GGUF; docs/cpu-kernels.md#the-accuracy-budget), none with --dtype float32")
    m.add_argument("--linear-kernels", default=model.linear_kernels, metavar="SPEC",
                   help="pin CPU linear kernels instead of timing them: comma-separated LAYER[@ROWS]=KERNEL, "
                        "LAYER a linear's name in the model (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head) "
                        "or * for all, ROWS a batch bucket (1, 8, 32, 128, 512; default: all), KERNEL one of "
                        "docs/cpu-kernels.md's (e.g. '*=linear_onednn,down_proj@1=int8_gemv'); "
                        "overrides --quantization for those layers; pinned plans are never timed nor cached")
    m.add_argument("--max-model-len", type=int, default=model.max_model_len,
                   help="longest prompt + output in tokens (default: the model's context length)")
    m.add_argument("--seed", type=int, default=model.seed, help="seed for torch's global generator")
    m.add_argument("--tokenizer", default=model.tokenizer,
                   help="the vocabulary for structured output (JSON schema, regex, choice, grammar): a .gguf or a "
                        "folder with tokenizer.json (default: the model's own)")

    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=cache.block_size, help="tokens per KV block")
    c.add_argument("--num-blocks", type=int, default=cache.num_blocks,
                   help="KV blocks (default: as many as --kv-cache-memory-gib holds)")
    c.add_argument("--kv-cache-memory-gib", type=float, default=cache.kv_cache_memory_gib,
                   help="memory for the KV cache when --num-blocks is not given")
    c.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    c.add_argument("--kv-cache-dtype", default=cache.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="the KV cache's element type: auto (the model's dtype), bf16, fp32, int8 (8-bit codes and a "
                        "scale per token and head: about half bf16's bytes, so about twice the tokens in "
                        "--kv-cache-memory-gib, and faster long-context decode; docs/kv-cache-dtype.md) or "
                        "fp8_e4m3 (CUDA GPUs with fp8)")

    s = p.add_argument_group("scheduler")
    s.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens,
                   help="prompt tokens one step computes, its running decodes on top (default: 512 on CPU, "
                        "where a 2,048-token step takes ~1 s and stalls every stream that long; 2048 on CUDA; "
                        "without chunked prefill at least --max-model-len)")
    s.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs, help="most requests running at once")
    s.add_argument("--policy", default=sched.policy, choices=["fcfs", "priority"], help="scheduling policy")
    s.add_argument("--no-chunked-prefill", action="store_true", help="turn chunked prefill off")

    d = p.add_argument_group("device")
    d.add_argument("--device", default=device.device, choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when available, else cpu")
    d.add_argument("--attention-backend", default=device.attention_backend,
                   choices=["auto", "torch", "cpp", "triton"],
                   help="auto: triton on cuda; on cpu the C++ kernel (built once into ~/.cache/tandem), "
                        "or torch when no C++ compiler is found")
    d.add_argument("--num-threads", type=int, default=device.num_threads,
                   help="torch CPU threads (default: torch's own choice)")
    d.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs and no fused layer ops: every layer runs plain torch ops (by default "
                        "graphs capture decode batches on CUDA, and layers use fused C++ / Triton ops)")
    d.add_argument("--cuda-graph-max-batch-size", type=int, default=device.cuda_graph_max_batch_size,
                   help="largest decode batch captured as a CUDA graph (also capped by --max-num-seqs)")
    d.add_argument("--overlap", default=device.overlap, choices=["auto", "on", "off"],
                   help="schedule and prepare the next step while this one runs (docs/gpu.md); "
                        "auto: on for cuda, off on cpu")
    d.add_argument("--batch-invariant", action="store_true",
                   help="a request's greedy tokens and logprobs do not depend on its batch, a cached prefix or "
                        "chunked prefill: fixed-order kernels at every batch size, at a measured cost "
                        "(docs/batch-invariance.md); float linears only, no --linear-kernels")
    d.add_argument("--no-warm-up", action="store_true",
                   help="say ready without first running dummy requests at every batch and token shape a step "
                        "meets: starts sooner, but the first requests wait for kernels to compile "
                        "(docs/gpu.md#ready-means-warm)")

    lora = defaults.lora
    la = p.add_argument_group("LoRA adapters (docs/lora.md)")
    la.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters beside the base model (loaded at run time by AdminService, or --lora)")
    la.add_argument("--lora", action="append", metavar="NAME=PATH", type=_lora_flag,
                    help="load the PEFT adapter folder PATH as NAME at start (repeatable; implies --enable-lora)")
    la.add_argument("--max-loras", type=int, default=lora.max_loras,
                    help="device slots: the most distinct adapters in one step (requests of another wait)")
    la.add_argument("--max-lora-rank", type=int, default=lora.max_lora_rank,
                    help="the highest adapter rank served; every slot is this wide")
    la.add_argument("--max-cpu-loras", type=int, default=lora.max_cpu_loras,
                    help="adapters kept in host memory, least recently used pushed out (read again from their "
                         "folder when used) unless pinned (default: --max-loras)")
    la.add_argument("--lora-kernel", default=lora.kernel, choices=LORA_KERNELS,
                    help="auto: Triton on CUDA, on CPU the fastest measured per batch size; or one kernel")

    spec = SpeculativeConfig()
    sd = p.add_argument_group("speculative decoding (docs/speculative-decoding.md)")
    sd.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=spec.method,
                    help="propose tokens and verify them in one forward: ngram (prompt lookup in the request's own "
                         "tokens) or draft (a smaller model of the same tokenizer, --draft-model). Unset: off. Output "
                         "is unchanged; a request turns it off with sampling_params.speculative false")
    sd.add_argument("--num-speculative-tokens", type=int, default=spec.num_speculative_tokens, metavar="K",
                    help="tokens proposed per request and step")
    sd.add_argument("--prompt-lookup-min", type=int, default=spec.prompt_lookup_min, metavar="N",
                    help="ngram: the shortest suffix looked up in the request's tokens")
    sd.add_argument("--prompt-lookup-max", type=int, default=spec.prompt_lookup_max, metavar="N",
                    help="ngram: the longest suffix looked up")
    sd.add_argument("--draft-model", default=spec.draft_model, metavar="PATH",
                    help="draft: the smaller model, with the same tokenizer (a HF folder or a .gguf)")
    sd.add_argument("--speculative-max-batch", type=int, default=spec.max_batch, metavar="N",
                    help=f"speculate only in steps with at most N running requests (default: by device, "
                         f"{DEFAULT_SPECULATIVE_MAX_BATCH}; above it verifying drafts costs more than it saves)")
    return p


def _lora_flag(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora takes NAME=PATH (a PEFT adapter folder), got {value!r}")
    return name, path


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags; ValueError on a bad value or a missing model."""
    if args.model is not None and not Path(args.model).exists():
        raise ValueError(f"model {args.model!r} not found: give a Hugging Face folder or a .gguf file")
    if args.draft_model is not None and not Path(args.draft_model).exists():
        raise ValueError(f"draft model {args.draft_model!r} not found: give a Hugging Face folder or a .gguf file")
    if args.tokenizer is not None and not Path(args.tokenizer).exists():
        raise ValueError(f"tokenizer {args.tokenizer!r} not found: give a folder with tokenizer.json or a .gguf file")
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                          linear_kernels=args.linear_kernels, max_model_len=args.max_model_len, seed=args.seed,
                          tokenizer=args.tokenizer),
        cache=CacheConfig(
            block_size=args.block_size, num_blocks=args.num_blocks,
            kv_cache_memory_gib=args.kv_cache_memory_gib, enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            policy=args.policy, enable_chunked_prefill=not args.no_chunked_prefill,
        ),
        device=DeviceConfig(
            device=args.device, attention_backend=args.attention_backend, num_threads=args.num_threads,
            enforce_eager=args.enforce_eager, cuda_graph_max_batch_size=args.cuda_graph_max_batch_size,
            overlap=args.overlap, batch_invariant=args.batch_invariant, warm_up=not args.no_warm_up,
        ),
        lora=LoraConfig(enable=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_cpu_loras=args.max_cpu_loras, kernel=args.lora_kernel, adapters=dict(args.lora or ())),
        speculative=SpeculativeConfig(
            method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
            prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
            draft_model=args.draft_model, max_batch=args.speculative_max_batch,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        parser.exit(2, "tandem-engine: error: the engine core needs torch, which this install lacks "
                       "(the client and frontend only); install the engine with: pip install 'tandem[engine]'\n")
    try:  # before the model loads: a taken port is said at once, not after minutes of loading
        ensure_can_listen(args.host, args.port)
        ensure_can_listen(args.host, args.metrics_port, "--metrics-port")
    except PortUnavailable as exc:
        print(f"tandem-engine: {exc}", file=sys.stderr)
        return 1
    configure_logging(args.log_level, args.log_format)
    limit_openmp_spinning()  # before torch loads: idle OpenMP workers must leave the cores to others
    tracer_provider = None
    try:
        config = config_from_args(args)
        transport = security_flags.server_transport_from_args(args)
        tracer_provider = setup_tracing(telemetry_flags.tracing_settings(args, "tandem-engine"))
        from services.engine.server import EngineServer  # torch loads here, after the flags are checked

        server = EngineServer(config, f"{args.host}:{args.port}", stall_timeout=args.stall_timeout,
                              max_pending_outputs=args.max_pending_outputs, burst_window_s=args.burst_window_ms / 1000,
                              transport=transport, tracer_provider=tracer_provider,
                              metrics_port=args.metrics_port, metrics_host=args.host)
        from services.engine.processes.engine_process import serve_on_main_thread

        def announce(port: int) -> None:
            print(f"tandem-engine listening on {args.host}:{port}", flush=True)

        try:
            # the engine steps on this, the main thread; gRPC is served from a process of its own
            status = serve_on_main_thread(server, sys.argv[1:] if argv is None else list(argv), announce,
                                          grace=args.grace, step_cpu=args.step_cpu)
        except RuntimeError as exc:  # the server process could not listen: "Failed to bind to address ..."
            raise explain_bind_failure(args.host, args.port, "--port", exc) from None
        if status != 0:
            logging.getLogger("tandem.engine").error("the gRPC server process exited with status %d", status)
            return 1
    except PortUnavailable as exc:  # taken since the check above (or the metrics port)
        print(f"tandem-engine: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:
        parser.exit(2, f"tandem-engine: error: {exc}\n")
    finally:
        shutdown_tracing(tracer_provider)
    return 0


if __name__ == "__main__":
    sys.exit(main())
