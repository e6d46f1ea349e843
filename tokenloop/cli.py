"""The `tokenloop` command: generate, chat, perplexity, serve, bench, train, models, pull."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tokenloop.bench import frontend as frontend_bench
from tokenloop.bench import kv_cache as kv_bench
from tokenloop.bench import offline as offline_bench
from tokenloop.bench import pd as pd_bench
from tokenloop.bench import route as route_bench
from tokenloop.bench import serve_peers as serve_bench
from tokenloop.bench import train as train_bench
from tokenloop.models import store
from tokenloop.train import command as train_command
from tokenloop.train import drafter_command


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", "-m", default=None, help=f"known name, .gguf file or HF folder (default {store.DEFAULT_MODEL})"
    )
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="torch device (default: the accelerator if any, else the CPU)")
    p.add_argument("--max-tokens", type=int, default=256)
    # llama.cpp's sampling defaults, and ollama's repeat penalty: greedy decoding of a small model loops (SmolLM2
    # repeated one sentence to the length limit, and "I am a British man." in chat).
    p.add_argument("--temperature", "-t", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="-1 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="0 = off (default 0.05)")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.1,
        help="transformers' rule over prompt and output; 1 = off (default 1.1)",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output (default 0)")
    p.add_argument(
        "--no-repeat-ngram-size",
        type=int,
        default=0,
        help="no n-gram of this size twice, prompt included (default 0: off)",
    )
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop token before this many tokens")
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="TOKEN_ID=BIAS",
        help="added to a token's logit, in [-100, 100] (repeatable)",
    )
    p.add_argument("--bad-word", action="append", default=[], help="a word never to end the output with (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print prompt and decode tokens/s")
    _add_kv_cache_dtype_arg(p)
    _add_threads_arg(p)
    _add_compile_arg(p)
    _add_speculative_arg(p)


def _add_speculative_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help=(
            'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
            'or \'{"method": "draft", "model": NAME}\' or \'{"method": "eagle", "model": DRAFTER_FOLDER}\''
        ),
    )


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {type(value).__name__}")
    return value


def _add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    from tokenloop.engine.config import KV_CACHE_DTYPES

    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="auto: 16 bits on the fast path, the model's dtype otherwise; int8: twice the tokens (default auto)",
    )


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the model (default: one per core that is idle at start)",
    )


def _add_compile_arg(p: argparse.ArgumentParser) -> None:
    from tokenloop.engine.config import compile_by_default

    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=compile_by_default(),
        help=(
            "decode steps as one compiled C++ call "
            "(the default; a first start runs eager while it compiles in the background)"
        ),
    )


def _sampling_params(args):
    from tokenloop.sampling.params import SamplingParams

    logit_bias = {}
    for item in args.logit_bias:
        token, _, bias = item.partition("=")
        try:
            logit_bias[int(token)] = float(bias)
        except ValueError:
            raise ValueError(f"--logit-bias takes TOKEN_ID=BIAS, got {item!r}") from None
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
        min_tokens=args.min_tokens,
        logit_bias=logit_bias or None,
        bad_words=args.bad_word,
    )


def _llm(args, compile: bool):
    from tokenloop.llm import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        compile=compile,
        threads=args.threads,
        speculative_config=getattr(args, "speculative_config", None),
    )


def cmd_generate(args) -> int:
    from tokenloop.engine.streaming import StreamStats, stream

    params = _sampling_params(args)
    llm = _llm(args, args.compile)
    if args.strategy != "sample":
        print(_strategy(llm, args, params))
        return 0
    stats = StreamStats()
    for delta in stream(llm.llm_engine, args.prompt, params, stats):
        print(delta, end="", flush=True)
    print()
    if args.stats:
        print(stats.summary(), file=sys.stderr)
        if llm.llm_engine.speculator is not None:
            print(llm.llm_engine.speculator.stats.summary(), file=sys.stderr)
    return 0


def _strategy(llm, args, params) -> str:
    """Several continuations of the prompt at once (--strategy): the best beam, the voted answer, or an outline
    expanded point by point. Printed when done (nothing to stream: the result is known only at the end)."""
    from dataclasses import replace

    from tokenloop.engine.beam_search import BeamSearchParams

    if args.strategy == "beam":
        out = llm.beam_search(
            args.prompt, BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens), use_tqdm=False
        )[0]
        return out.outputs[0].text
    if args.strategy == "vote":
        vote = llm.self_consistency(
            llm.chat_prompt([{"role": "user", "content": args.prompt}]), args.n, args.answer, params
        )
        shares = ", ".join(f"{answer}: {count}" for answer, count in vote.votes.items())
        print(f"votes ({len(vote.samples)} of {args.n} samples): {shares or 'no answer'}", file=sys.stderr)
        return vote.answer if vote.answer is not None else ""
    return llm.skeleton_of_thought(args.prompt, replace(params, max_tokens=min(args.max_tokens, 128))).answer


def cmd_chat(args) -> int:
    from tokenloop.engine.streaming import StreamStats, stream

    params = _sampling_params(args)
    llm = _llm(args, args.compile)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    print(
        "Chat with the model. /reset clears the conversation; Ctrl-C stops a reply; "
        "/exit, Ctrl-D or Ctrl-C at the prompt quits.",
        file=sys.stderr,
    )
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if user.strip() == "/exit":
            return 0
        if user.strip() == "/reset":
            history.clear()
            continue
        if not user.strip():
            continue
        history.append({"role": "user", "content": user})
        stats = StreamStats()
        reply = ""
        # Earlier turns are still in the prefix cache: only the new turn is prefilled.
        replying = stream(llm.llm_engine, llm.chat_prompt(system + history), params, stats)
        try:
            for delta in replying:
                reply += delta
                print(delta, end="", flush=True)
        except KeyboardInterrupt:  # stops this reply (the request is aborted); the conversation goes on
            replying.close()
            print(" [stopped]", file=sys.stderr)
        print()
        history.append({"role": "assistant", "content": reply})
        if args.stats:
            print(stats.summary(), file=sys.stderr)


def cmd_perplexity(args) -> int:
    from tokenloop.engine.perplexity import perplexity

    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except OSError as e:  # checked before the model loads
        raise ValueError(f"cannot read {args.file}: {e.strerror or e}") from None
    llm = _llm(args, compile=False)  # scoring is all prefill: nothing for the compiled decode step to do
    start = time.perf_counter()
    result = perplexity(llm, text, window=args.window, max_tokens=args.max_tokens)
    seconds = time.perf_counter() - start
    print(
        f"perplexity {result.perplexity:.3f} over {result.num_scored_tokens} tokens "
        f"(window {args.window}, dtype {args.dtype}, KV cache {args.kv_cache_dtype}) in {seconds:.1f} s"
    )
    return 0


def _cores(spec: str | None) -> tuple[int, ...] | None:
    """'0,1' -> (0, 1)."""
    if spec is None:
        return None
    try:
        return tuple(int(core) for core in spec.split(","))
    except ValueError:
        raise ValueError(f"cores are given as a comma-separated list of CPU numbers, got {spec!r}") from None


def _engine_config(args, **more):
    """The engine flags serve and batch share, and `more`."""
    from tokenloop.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_gb=args.kv_cache_gb,
        kv_cache_dtype=args.kv_cache_dtype,
        compile=args.compile,
        threads=args.threads,
        speculative_config=args.speculative_config,
        **more,
    )


def cmd_serve(args) -> int:
    from tokenloop.engine.async_engine import AsyncEngineConfig
    from tokenloop.engine.lora import LoRARequest
    from tokenloop.server.serve import ServerConfig, serve

    engine_config = _engine_config(
        args,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        inject_faults=tuple(args.inject_fault),
        lora_modules=tuple(LoRARequest.parse(spec) for spec in args.lora),
    )
    limits = AsyncEngineConfig(
        max_waiting=args.max_waiting, unread_timeout_s=args.unread_timeout, stall_timeout_s=args.stall_timeout
    )
    if args.replicas is not None and args.disaggregate:
        raise ValueError("--replicas and --disaggregate: one or the other")
    disaggregation = None
    if args.disaggregate:
        from tokenloop.disaggregation.frontend import DisaggregationConfig

        if args.threads is not None:
            raise ValueError("--threads: with --disaggregate each worker runs a thread per core it is given")
        disaggregation = DisaggregationConfig(
            args.prefill_workers,
            args.decode_workers,
            _cores(args.prefill_cores),
            _cores(args.decode_cores),
            args.min_prefill_tokens,
        )
    config = ServerConfig(
        args.served_model_name or args.model or store.DEFAULT_MODEL,
        args.host,
        args.port,
        args.api_key,
        max_n=args.max_n,
        max_body_mb=args.max_body_mb,
        shutdown_timeout=args.shutdown_timeout,
        limits=limits,
        disaggregation=disaggregation,
    )
    if args.replicas is not None:
        from tokenloop.scale_out.app import ReplicaConfig, serve_replicas

        serve_replicas(engine_config, config, ReplicaConfig(args.replicas, args.router, args.ray_address))
        return 0
    serve(engine_config, config)
    return 0


def cmd_explore(args) -> int:
    """`serve`, and once /health answers, the explorer page in the default browser (the API key in the address's
    fragment, which never reaches the server's logs)."""
    import threading
    import urllib.request
    import webbrowser

    if args.replicas is not None or args.disaggregate:
        raise ValueError("explore runs one engine: --replicas and --disaggregate are for serve")
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    page = f"{url}/explore" + (f"#key={args.api_key}" if args.api_key else "")

    def open_when_up() -> None:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        print(f"explorer: {page}", file=sys.stderr, flush=True)
        if not args.no_open:
            webbrowser.open(page)

    threading.Thread(target=open_when_up, daemon=True).start()
    return cmd_serve(args)


def cmd_batch(args) -> int:
    from tokenloop.scale_out.batch import run_batch

    config = _engine_config(args)
    failed = run_batch(args.input, args.output, config, args.replicas, args.batch_size, args.ray_address)
    return 1 if failed else 0


def cmd_models(args) -> int:
    for name, model in store.KNOWN_MODELS.items():
        where = str(store.cached_path(name)) if store.is_pulled(name) else "not pulled"
        default = " (default)" if name == store.DEFAULT_MODEL else ""
        print(f"{name}{default}\n  {model.description}\n  {where}")
    return 0


def cmd_pull(args) -> int:
    path = store.pull(args.name)
    if args.compile:  # the kernels and the decode package too, so that the first generate starts on the fast path
        from tokenloop.engine.config import EngineConfig
        from tokenloop.engine.llm_engine import LLMEngine

        LLMEngine(EngineConfig(model=str(path), kv_cache_gb=0.01, compile=True, compile_in_background=False))
    print(path)
    return 0


def _log_progress_to_stderr() -> None:
    """tokenloop's progress lines (model fetch, kernel build, background compile) on stderr, as plain lines:
    stdout carries only what the command generates."""
    import logging

    class StderrLines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            print(f"tokenloop: {record.getMessage()}", file=sys.stderr, flush=True)  # sys.stderr as it is now

    logger = logging.getLogger("tokenloop")
    if not any(type(h).__name__ == "StderrLines" for h in logger.handlers):
        logger.addHandler(StderrLines())
        logger.setLevel(logging.INFO)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """What `serve` and `explore` take."""
    p.add_argument(
        "--model", "-m", default=None, help=f"known name, .gguf file or HF folder (default {store.DEFAULT_MODEL})"
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a LoRA adapter (PEFT folder) served as model NAME beside the base model, batched with it (repeatable)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /explore/api routes")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory for the paged KV cache")
    _add_kv_cache_dtype_arg(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-n", type=int, default=128, help="largest n (and best_of) a request may ask for")
    p.add_argument(
        "--max-body-mb", type=float, default=8.0, help="largest request body in MiB; beyond it a 413 (default 8)"
    )
    p.add_argument(
        "--max-waiting", type=int, default=256, help="requests waiting for their first token; beyond it a 429"
    )
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds running requests may go on after SIGTERM"
    )
    p.add_argument(
        "--unread-timeout", type=float, default=300.0, help="seconds a request paused for a slow reader may wait"
    )
    p.add_argument(
        "--stall-timeout", type=float, default=4.0, help="seconds without a step after which /health says 503"
    )
    p.add_argument(
        "--inject-fault", action="append", default=[], help=argparse.SUPPRESS
    )  # tests: STAGE:TOKEN_ID (engine/faults.py)
    _add_threads_arg(p)
    _add_compile_arg(p)
    _add_speculative_arg(p)
    p.add_argument(
        "--disaggregate",
        action="store_true",
        help="prefill and decode in worker processes of their own, KV handed over in shared memory",
    )
    p.add_argument("--prefill-workers", type=int, default=1, help="with --disaggregate (default 1)")
    p.add_argument("--decode-workers", type=int, default=1, help="with --disaggregate (default 1)")
    p.add_argument(
        "--prefill-cores", default=None, help="with --disaggregate: CPUs for prefill, e.g. 0,1 (default: half of them)"
    )
    p.add_argument("--decode-cores", default=None, help="with --disaggregate: CPUs for decode (default: the others)")
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help='N engine replicas on Ray Serve behind one ingress (pip install "tokenloop[ray]")',
    )
    p.add_argument(
        "--router",
        choices=["prefix", "round-robin", "pow2"],
        default="prefix",
        help="with --replicas: prefix (the replica holding the prompt's leading blocks), round-robin, or pow2",
    )
    p.add_argument("--ray-address", default=None, help="with --replicas: a Ray cluster to join (default: start one)")
    p.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=256,
        help="with --disaggregate: shorter prompts are computed by the decode worker itself (default 256)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenloop", description="Generate text with LLMs, token by token.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generate", help="stream the continuation of a prompt")
    p.add_argument("prompt")
    _add_model_args(p)
    p.add_argument(
        "--strategy",
        choices=["sample", "beam", "vote", "skeleton"],
        default="sample",
        help="sample (stream one continuation, the default); beam: beam search; vote: self-consistency over "
        "--n chat answers read by --answer; skeleton: an outline, its points expanded together",
    )
    p.add_argument("--beam-width", type=int, default=4, help="beams, with --strategy beam (default 4)")
    p.add_argument("--n", type=int, default=8, help="samples voting, with --strategy vote (default 8)")
    p.add_argument(
        "--answer",
        default=r"[Tt]he answer is:?\s*(-?[0-9][0-9,.]*)",
        help="regex with one group that reads a sample's answer, with --strategy vote",
    )
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("chat", help="multi-turn chat in the terminal")
    p.add_argument("--system", default=None, help="system message")
    _add_model_args(p)
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("perplexity", help="perplexity of the model on a text file")
    p.add_argument("file")
    p.add_argument(
        "--model", "-m", default=None, help=f"known name, .gguf file or HF folder (default {store.DEFAULT_MODEL})"
    )
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="torch device (default: the accelerator if any, else the CPU)")
    p.add_argument("--window", type=int, default=512, help="tokens per window; each window is a fresh context")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    _add_kv_cache_dtype_arg(p)
    _add_threads_arg(p)
    p.set_defaults(func=cmd_perplexity)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("explore", help="serve, and open the explorer page (/explore) in the browser")
    _add_serve_args(p)
    p.add_argument("--no-open", action="store_true", help="print the page's address, open no browser")
    p.set_defaults(func=cmd_explore)
    p = sub.add_parser("batch", help='an offline batch of JSON lines on Ray Data (pip install "tokenloop[ray]")')
    from tokenloop.scale_out.batch import add_arguments as add_batch_arguments

    add_batch_arguments(p)
    p.add_argument(
        "--model", "-m", default=None, help=f"known name, .gguf file or HF folder (default {store.DEFAULT_MODEL})"
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory for each engine's KV cache")
    _add_kv_cache_dtype_arg(p)
    _add_threads_arg(p)
    _add_compile_arg(p)
    _add_speculative_arg(p)
    p.set_defaults(func=cmd_batch)
    p = sub.add_parser("bench", help="tokenloop beside llama.cpp and transformers on the same GGUF (or: bench serve)")
    offline_bench.add_arguments(p)
    p.set_defaults(func=offline_bench.main_from_args)
    bench = p.add_subparsers(dest="bench")
    for name, module, help in (
        ("serve", serve_bench, "load an OpenAI-compatible server: TTFT, inter-token latency, throughput"),
        ("frontend", frontend_bench, "a running stream and /health while a server does input work beside them"),
        ("pd", pd_bench, "colocated serving against prefill/decode disaggregation, one mixed load"),
        ("route", route_bench, "the replica routers (prefix, round-robin) on a multi-tenant load"),
        ("train", train_bench, "training tokens/s and memory beside transformers + peft, same data"),
        ("kv", kv_bench, "the int8 KV cache against the 16-bit one: perplexity, tokens per pool, long-context decode"),
    ):
        p = bench.add_parser(name, help=help)
        module.add_arguments(p)
        p.set_defaults(func=module.main_from_args)
    train_command.add_arguments(sub.add_parser("train", help="fine-tune a model on JSONL data, full or LoRA"))
    drafter_command.add_arguments(sub.add_parser("train-drafter", help="train an EAGLE drafter for a model"))
    sub.add_parser("models", help="list known models").set_defaults(func=cmd_models)
    p = sub.add_parser("pull", help="fetch a known model into the local store, and compile its decode step")
    p.add_argument("name")
    _add_compile_arg(p)
    p.set_defaults(func=cmd_pull)
    args = parser.parse_args(argv)
    if args.command != "serve":  # (serve logs everything its own way)
        _log_progress_to_stderr()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
