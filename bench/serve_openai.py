"""Decode speed as an OpenAI client sees it: stream completions from a running `colibri-plan serve` and
compare the client's tok/s with the engine's own measured decode rate (issue 28's acceptance: within 10%).

    colibri-plan serve --model PACK --plan PLAN --port 8000 &
    python bench/serve_openai.py --url http://127.0.0.1:8000/v1 --prompt-file prompt.txt --tokens 64 \\
        --requests 5 --verify-report verify.json --out bench/results/serve-openai.json

Each request streams (``stream_options.include_usage``); the client's decode rate is (tokens - 1) over the
time from the first streamed piece to the last, the prefill excluded as the engine's decode figure
excludes it. The engine's rate is the verify report's measured ``tok_s`` (or a `run --json` document's)
when given, else the server's own ``usage.decode_tok_s``. Prints one row per request and a summary;
writes the JSON document to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return v


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 base URL")
    ap.add_argument("--model", default=None, help="model id [the first of /v1/models]")
    ap.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (a model with a tokenizer)")
    src.add_argument("--prompt-ids", default=None, help="prompt token ids, e.g. 1,2,3")
    src.add_argument("--prompt-file", default=None, help="a file of token ids (or of text)")
    ap.add_argument("--chat", action="store_true", help="send the text prompt to /v1/chat/completions")
    ap.add_argument("--tokens", type=_positive, default=64, help="max_tokens of each request [64]")
    ap.add_argument("--requests", type=_positive, default=5, help="timed requests, one after another [5]")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests first [1]")
    ap.add_argument("--verify-report", default=None,
                    help="a verify report (or a `run --json` document): its measured tok_s is the "
                         "engine's rate")
    ap.add_argument("--out", default=None, help="write the JSON document here")
    args = ap.parse_args(argv)
    if args.chat and args.prompt is None:
        ap.error("--chat needs --prompt TEXT")
    if args.verify_report is not None and not Path(args.verify_report).is_file():
        ap.error(f"--verify-report {args.verify_report}: no such file")
    if args.out is not None and not Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out {args.out}: its folder does not exist")
    return args


def _prompt(args, report: dict | None):
    """Text or a list of ids: the options', else the verify report's prompt (the one its tok_s was
    measured on), else 8 ids."""
    if args.prompt is not None:
        return args.prompt
    if args.prompt_ids is None and args.prompt_file is None and (report or {}).get("settings", {}).get(
            "prompt_ids"):
        return list(report["settings"]["prompt_ids"])
    text = args.prompt_ids if args.prompt_ids is not None else (
        Path(args.prompt_file).read_text(encoding="utf-8") if args.prompt_file else "1 2 3 4 5 6 7 8")
    items = text.replace(",", " ").split()
    return [int(t) for t in items] if items and all(t.isdigit() for t in items) else text


def one_request(client, model: str, prompt, n: int, chat: bool) -> dict:
    """Stream one request; returns its timings (seconds) and the server's usage."""
    kw = dict(model=model, max_tokens=n, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    stream = (client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw) if chat
              else client.completions.create(prompt=prompt, **kw))
    first = last = None
    usage = None
    for chunk in stream:
        if chunk.choices:
            piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    tokens = (usage or {}).get("completion_tokens") or 0
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
    return {"tokens": tokens, "ttft_s": None if first is None else first - t0,
            "total_s": time.perf_counter() - t0, "client_tok_s": decode,
            "server_tok_s": (usage or {}).get("decode_tok_s"), "usage": usage}


def main(argv=None) -> int:
    args = parse_args(argv)
    import openai

    client = openai.OpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    report = json.loads(Path(args.verify_report).read_text()) if args.verify_report else None
    prompt = _prompt(args, report)
    for _ in range(max(0, args.warmup)):
        one_request(client, model, prompt, args.tokens, args.chat)
    rows = [one_request(client, model, prompt, args.tokens, args.chat) for _ in range(args.requests)]
    print(f"{'request':>7} {'tokens':>6} {'TTFT ms':>9} {'client tok/s':>12} {'server tok/s':>12}")
    for i, r in enumerate(rows):
        f = lambda v, s: "n/a" if v is None else f"{v * s:.2f}"  # noqa: E731
        print(f"{i:>7} {r['tokens']:>6} {f(r['ttft_s'], 1e3):>9} {f(r['client_tok_s'], 1):>12} "
              f"{f(r['server_tok_s'], 1):>12}")
    client_rate = statistics.median([r["client_tok_s"] for r in rows if r["client_tok_s"]] or [0.0])
    server_rate = statistics.median([r["server_tok_s"] for r in rows if r["server_tok_s"]] or [0.0])
    engine, source = server_rate, "server usage.decode_tok_s"
    if report is not None:
        engine = (report.get("measured") or report).get("tok_s") or engine
        source = f"verify report {args.verify_report} (measured tok_s)"
    ratio = client_rate / engine if engine else None
    doc = {"url": args.url, "model": model, "tokens": args.tokens, "prompt": prompt, "requests": rows,
           "client_tok_s_median": client_rate, "server_tok_s_median": server_rate,
           "engine_tok_s": engine, "engine_source": source, "client_over_engine": ratio,
           "within_10_percent": ratio is not None and ratio >= 0.9}
    verdict = "n/a" if ratio is None else \
        f"x{ratio:.3f}, {'within' if doc['within_10_percent'] else 'NOT within'} 10%"
    print(f"client {client_rate:.2f} tok/s (median), engine {engine:.2f} tok/s ({source}): {verdict}")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
